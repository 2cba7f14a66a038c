"""The two optimizers of a round: the clients' local one (`client`) and the server's step on the pseudo-gradient (`server`)."""
