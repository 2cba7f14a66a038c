"""Studies over many runs: the tail leaderboard (`leaderboard`), the tuner (`tuning`) and the empirical privacy audit (`audit`)."""
