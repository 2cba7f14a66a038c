"""The lane executor: client evaluation and local SGD for many models in one jitted program.

Delta-FL's round (Algorithm 2) does two kinds of client work for every replica r (one model per
conformity level theta and seed): F_k(w_t) on every sampled client (line 4,
:mod:`deltafl_jax.engine.evaluate`) and LocalUpdate on the clients that pass the filter
(lines 7-8, :mod:`deltafl_jax.engine.train`). Both are flattened into work items that lanes
run inside ``lax.while_loop``s whose trip counts come from the data
(:mod:`deltafl_jax.engine.lanes`).
"""

from deltafl_jax.engine.evaluate import EvalLayout, EvalResult, EvalStreams, evaluate_streams
from deltafl_jax.engine.lanes import (LANE_MODES, LaneDeal, LoopShape, deal_jobs, loop_shape,
                                      per_lane)
from deltafl_jax.engine.client import (LOCAL_SGD, AdaptState, ClientJob, ClientUpdate,
                                       LocalState, difference, fine_tune_step, local_final,
                                       local_init, optimizer_step)
from deltafl_jax.engine.train import (ClientInputs, JobChoice, LocalSGDConfig, ReplicaRound,
                                      TrainResult, train_jobs)
from deltafl_jax.engine.trees import tree_all_finite, tree_sqnorm

__all__ = ["EvalLayout", "EvalResult", "EvalStreams", "evaluate_streams", "LANE_MODES", "LaneDeal", "LoopShape", "deal_jobs",
           "loop_shape", "per_lane",
           "LOCAL_SGD", "AdaptState", "ClientJob", "ClientUpdate", "LocalState", "difference",
           "fine_tune_step", "local_final", "local_init", "optimizer_step", "ClientInputs", "JobChoice", "LocalSGDConfig", "ReplicaRound", "TrainResult", "train_jobs",
           "tree_all_finite", "tree_sqnorm"]
