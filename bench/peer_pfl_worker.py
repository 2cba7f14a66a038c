r"""pfl-research's own FedAvg simulation on its CIFAR-10 benchmark configuration, driven round by
round over stdin/stdout.

Run by ``bench/peer_pfl.py`` with the python of a virtual environment that holds ``pfl`` and
PyTorch (``--pfl_python``); it imports neither deltafl_jax nor the rest of bench/ (only its
sibling ``peer_common``, standard library).

    <pfl venv>/bin/python bench/peer_pfl_worker.py --num_clients=1000 --client_size=50

What runs is pfl's simulation API as its benchmark ``benchmarks/image_classification/pytorch/
train.py`` assembles it: a ``FederatedDataset.from_slices`` of users (a dict user -> [images,
labels] of torch tensors, users drawn by ``get_user_sampler('random', ...)``), a
``PyTorchModel`` with ``torch.optim.SGD`` as the local and central optimizer, a
``SimulatedBackend`` with the ``WeightByUser`` postprocessor, and
``FederatedAveraging().run(...)`` with ``NNAlgorithmParams`` (cohort 50, no validation cohort)
and ``NNTrainHyperParams`` (one local epoch, batch 10, local learning rate 0.1; central
learning rate 1). The network is the benchmark's ``simple_cnn`` layers (NHWC images transposed
to NCHW, conv 3x3-32, ReLU, conv 3x3-64, ReLU, max-pool 2x2, dense 128, ReLU, dense 10,
Glorot-uniform weights), written here with ``torch.nn`` layers and without its two dropout
layers; the loss is the mean cross-entropy. The images are random N(0, 1) float32 32 x 32 x 3
(the benchmark's are standardised CIFAR pixels: the same shapes and dtype, so the same work).

pfl's training loop evaluates every user of the cohort before and after local training on
rounds where ``iteration % evaluation_frequency == 0``; the evaluation frequency is set beyond
the last round, so only round 0 (untimed warm-up) evaluates and every timed round trains only.

Protocol (``peer_common.serve``): ``READY <json>`` (versions, torch threads, the network's
parameter count, FLOPs of one training example counted by ``torch.utils.flop_counter``, and
torch's float32 GEMM rate and the median time of a bare PyTorch SGD step on one batch), then
for each ``round T`` line one federated round, ``DONE <json>`` with its seconds (from the end
of the previous round's callback to the end of this round's ``after_central_iteration``: pfl's
whole round, sampling and aggregation included) and the examples its local steps computed.
``quit`` (or the end of stdin) stops pfl's run at the next callback.
"""

from __future__ import annotations

import argparse
import time

from peer_common import pfl_round_callback, serve

PACKAGES = ("pfl", "torch", "numpy")


def build_network(num_classes: int, side: int, channels: int):
    """The benchmark CNN's layers, without dropout, with a ``loss`` and ``metrics`` method as
    pfl's ``PyTorchModel`` asks."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            pooled = (side - 4) // 2
            self.conv1 = nn.Conv2d(channels, 32, 3)
            self.conv2 = nn.Conv2d(32, 64, 3)
            self.dense1 = nn.Linear(pooled * pooled * 64, 128)
            self.dense2 = nn.Linear(128, num_classes)
            for layer in (self.conv1, self.conv2, self.dense1, self.dense2):
                nn.init.xavier_uniform_(layer.weight)
            self.examples = 0   # examples through loss(): the round's training work

        def forward(self, x):
            x = x.permute(0, 3, 1, 2)   # NHWC images, as the benchmark stores them
            x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
            x = torch.flatten(torch.max_pool2d(x, 2), 1)
            return self.dense2(torch.relu(self.dense1(x)))

        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            self.examples += len(x)
            return nn.functional.cross_entropy(self(x), y.long())

        @torch.no_grad()
        def metrics(self, x, y, eval=True):
            from pfl.metrics import Weighted
            self.eval() if eval else self.train()
            logits = self(x)
            loss = nn.functional.cross_entropy(logits, y.long(), reduction="sum")
            correct = (logits.argmax(-1) == y.long()).float().sum()
            return {"loss": Weighted(loss.item(), len(x)),
                    "accuracy": Weighted(correct.item(), len(x))}

    return Net()


def train_step_flops(net, batch: int, side: int, channels: int, num_classes: int) -> float:
    """FLOPs of one SGD step's forward and backward pass on `batch` examples, as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them (matrix products and
    convolutions), per example."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    device = next(net.parameters()).device
    x = torch.randn(batch, side, side, channels, device=device)
    y = torch.randint(0, num_classes, (batch,), device=device)
    with FlopCounterMode(display=False) as counter:
        net.loss(x, y).backward()
    net.zero_grad()
    net.examples = 0
    return counter.get_total_flops() / batch


def sgd_step_seconds(net, batch: int, side: int, channels: int, num_classes: int,
                     repeats: int = 30) -> float:
    """Median seconds of one bare PyTorch SGD step (forward, backward, update) on `batch`
    random images, outside pfl: the floor of pfl's local step."""
    import copy

    import torch

    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    device = next(net.parameters()).device
    x = torch.randn(batch, side, side, channels, device=device)
    y = torch.randint(0, num_classes, (batch,), device=device)
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        net.loss(x, y).backward()
        opt.step()
        synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[3:])
    return times[len(times) // 2]


def synchronize():
    """Wait for the GPU's queued work (nothing on a CPU)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """torch's float32 n x n GEMM rate on pfl's device (best of `repeats`)."""
    import torch
    from pfl.internal.ops.pytorch_ops import get_default_device
    a = torch.ones(n, n, device=get_default_device())
    torch.mm(a, a)
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, a)
        synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def federated_data(args):
    """1000 users of 50 random CIFAR-shaped images each, as ``FederatedDataset.from_slices``
    takes them (torch tensors on pfl's device, as the benchmark's ``numpy_to_tensor``)."""
    import numpy as np
    import torch
    from pfl.data import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.internal.ops.pytorch_ops import to_tensor

    rng = np.random.default_rng(args.seed)
    n = args.num_clients * args.client_size
    x = to_tensor(rng.standard_normal((n, args.side, args.side, args.channels),
                                      dtype=np.float32))
    y = to_tensor(rng.integers(0, args.num_classes, n).astype(np.int64), dtype=None)
    k = args.client_size
    users = {u: [x[u * k:(u + 1) * k], y[u * k:(u + 1) * k]] for u in range(args.num_clients)}
    return FederatedDataset.from_slices(users, get_user_sampler("random", list(users)))


def run(args):
    import numpy as np
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.pytorch_ops import get_default_device
    from pfl.model.pytorch import PyTorchModel

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    net = build_network(args.num_classes, args.side, args.channels).to(get_default_device())
    flops = train_step_flops(net, args.batch_size, args.side, args.channels, args.num_classes)
    params = sum(p.numel() for p in net.parameters())
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(list(net.parameters()), 1.0))
    backend = SimulatedBackend(training_data=federated_data(args), val_data=None,
                               postprocessors=[WeightByUser()])
    extra = {"torch_threads": torch.get_num_threads(), "parameters": params,
             "train_flops_per_example": flops, "torch_gemm_gflops": gemm_gflops(),
             "torch_step_s": sgd_step_seconds(net, args.batch_size, args.side, args.channels,
                                              args.num_classes)}
    commands = serve(PACKAGES, extra)
    first = next(commands, None)
    if first is None or first[0] != "round":
        return
    rounds = pfl_round_callback(net, commands, first[1], synchronize)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=args.max_rounds, evaluation_frequency=args.max_rounds + 1,
            train_cohort_size=args.cohort, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=args.learning_rate,
                                              local_num_epochs=1,
                                              local_batch_size=args.batch_size),
        model_eval_params=NNEvalHyperParams(local_batch_size=args.batch_size),
        callbacks=[rounds])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_clients", type=int, default=1000)
    ap.add_argument("--client_size", type=int, default=50)
    ap.add_argument("--cohort", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=10)
    ap.add_argument("--learning_rate", type=float, default=0.1)
    ap.add_argument("--side", type=int, default=32)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--num_classes", type=int, default=10)
    ap.add_argument("--max_rounds", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch_threads", type=int, default=0, help="0: torch's default")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
