"""Client-level differential privacy: the settings, the clip and the accounting (`dp`), and the noised secure sums with the quantile over them (`secagg`)."""
