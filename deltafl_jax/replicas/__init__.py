"""The replicas a run trains at once: their labels, their names and the grid a configuration asks of an algorithm (`labels`), and one configuration per seed (`seed_programs`)."""
