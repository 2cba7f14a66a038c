"""Buffered asynchronous aggregation: everything but the rule.

An asynchronous run keeps C clients training at once, each from the model version current
when it started, and steps the server whenever K updates have arrived (FedBuff, Nguyen et
al., AISTATS 2022, Algorithm 1). What every buffered method shares lives here:

- :mod:`deltafl_jax.asynchronous.scheduler`: the events on the virtual clock
  (:class:`~deltafl_jax.asynchronous.scheduler.AsyncScheduler`: jobs in flight from their
  base versions, the buffer, staleness, which versions the ring keeps) and the settings group
  :class:`~deltafl_jax.asynchronous.scheduler.AsyncSettings` (``--concurrency``,
  ``--buffer_size``, ``--max_staleness``), host-side NumPy;
- :mod:`deltafl_jax.asynchronous.rule`: :class:`~deltafl_jax.asynchronous.rule.BufferedRule`,
  the small part a method is (its staleness weight, its job weights, its aggregate, its
  buffer, its refill and draw policy), the :class:`~deltafl_jax.asynchronous.rule.StepContext`
  its hooks read, and :class:`~deltafl_jax.asynchronous.rule.AsyncStep`, what a spec's
  ``asynchronous`` field holds;
- :mod:`deltafl_jax.asynchronous.step`: the server step on the device (the ring of versions,
  each job from its own base version, the losses at the base versions a rule may ask for);
- :mod:`deltafl_jax.asynchronous.run`: :class:`~deltafl_jax.asynchronous.run.BufferedRun`,
  the host side (one scheduler per seed, the plans, the mesh, the compiled step).

The rules (FedBuff, FedAsync, FedScale's form, buffered Delta-FL) are the algorithm modules
(:mod:`deltafl_jax.algorithms.buffered`), one file each; adding one is
``docs/guides/asynchronous.md``'s section *Adding an asynchronous rule*.
"""
