"""What a command does before JAX starts its backend: importing ``--model_module`` (its
models registered before ``--model`` is resolved), XLA's flags and joining a distributed run."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

from absl import flags

from deltafl_jax.errors import UsageError

FLAGS = flags.FLAGS


def import_model_module() -> None:
    """--model_module: import the module (a dotted name, or a path to a .py file) whose
    ``deltafl_jax.register_model`` calls make its models available to --model; once per
    process. UsageError (one line) when it cannot be imported."""
    name = FLAGS.model_module
    if not name:
        return
    try:
        if name.endswith(".py") or os.sep in name:
            path = os.path.abspath(name)
            if not os.path.isfile(path):
                raise UsageError(f"--model_module={name}: no such file")
            key = "deltafl_model_module_" + hashlib.sha1(path.encode()).hexdigest()[:12]
            if key in sys.modules:
                return
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[key]
                raise
        else:
            importlib.import_module(name)
    except UsageError:
        raise
    except Exception as e:  # pylint: disable=broad-except
        first = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"--model_module={name} cannot be imported ({type(e).__name__}: "
                         f"{first})") from None


def start_backend() -> None:
    """What must happen before JAX starts its backend: XLA flags (a built-in model's GPU
    flags, ``--deterministic``'s, ``--devices``') and joining a distributed run. Raises
    ConfigError when the run cannot be joined."""
    from deltafl_jax.models.registry import gpu_xla_flags
    os.environ["XLA_FLAGS"] = gpu_xla_flags(os.environ.get("XLA_FLAGS", ""),
                                            getattr(FLAGS, "model", ""))
    if FLAGS.deterministic:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_deterministic_ops=true").strip()
    if FLAGS.distributed:
        from deltafl_jax.run import distributed
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes,
                               FLAGS.process_id, FLAGS.distributed_timeout_s)
    else:   # on a CPU: --devices=D host devices; unset, one per core
        from deltafl_jax.engine.mesh import default_host_devices, host_device_flags
        devices = FLAGS.devices if FLAGS.devices is not None else default_host_devices()
        os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), devices)
