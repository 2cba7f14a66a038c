"""The run format: the one writer and reader of an output directory (`directory`) and serving a saved model (`serving`)."""
