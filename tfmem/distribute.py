"""tfmem under `tf.distribute`: which replica a call runs on, and that replica's budget.

A `tfmem.function` called inside `strategy.run` is traced once per replica (TensorFlow
traces a nested `tf.function` per device). Each trace is rewritten for *one device*:
the per-replica program, with the per-replica memory budget — the config's
`memory_budget` when set, else the device's share (`replica_budget`). The strategy
does the communication (all-reduce, `apply_gradients`) outside the rewritten program.

On CPU, logical devices (`tf.config.set_logical_device_configuration`) share one
process-wide BFC allocator: `TF_CPU_BFC_MEM_LIMIT_IN_MB` limits the process, and
`get_memory_info("CPU:0")` and `("CPU:1")` report the same numbers. A CPU replica's
budget is therefore the process limit divided by the number of CPU devices the
strategy uses on this worker; a real per-device limit on CPU needs one process per
device (MultiWorkerMirroredStrategy).

Example (in a fresh process: `split_cpu` must run before TensorFlow initialises its devices):
    >>> strategy = tf.distribute.MirroredStrategy(split_cpu(2))   # ['/cpu:0', '/cpu:1']
    >>> where = strategy.run(lambda: str(current_replica()))      # in each replica
    >>> for text in strategy.experimental_local_results(where):
    ...     print(text)
    MirroredStrategy replica 0 of 2 on /job:localhost/replica:0/task:0/device:CPU:0
    MirroredStrategy replica 1 of 2 on /job:localhost/replica:0/task:0/device:CPU:1
    >>> print(current_replica())                                  # outside strategy.run
    None
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.python.distribute import device_util

from tfmem.budget import Budget, resolve_budget
from tfmem.config import Config


@dataclasses.dataclass(frozen=True)
class Replica:
    """Where a call runs under a `tf.distribute` strategy.

    Attributes:
        strategy: the strategy's class name, e.g. "MirroredStrategy".
        replica_id: this replica's id in its sync group (None if not known when tracing).
        num_replicas: replicas in sync.
        device: this replica's device.
        local_devices: the devices the strategy uses on this worker (process).
    """

    strategy: str
    replica_id: int | None
    num_replicas: int
    device: str
    local_devices: tuple[str, ...]

    def __str__(self) -> str:
        replica = "?" if self.replica_id is None else self.replica_id
        return f"{self.strategy} replica {replica} of {self.num_replicas} on {self.device}"


def current_replica() -> Replica | None:
    """The replica this code runs in, or None outside `strategy.run` (or under the default strategy)."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    strategy = context.strategy
    replica_id = tf.get_static_value(context.replica_id_in_sync_group)
    # The strategy runs each replica under its device scope. (`ReplicaContext.devices`
    # is deprecated, and under MultiWorkerMirroredStrategy indexes this worker's
    # devices by the global replica id: IndexError on every worker but the first.)
    return Replica(strategy=_public_name(type(strategy)),
                   replica_id=None if replica_id is None else int(replica_id),
                   num_replicas=int(context.num_replicas_in_sync),
                   device=device_util.current() or "",
                   local_devices=tuple(strategy.extended.worker_devices))


def _public_name(cls: type) -> str:
    """The name TF exports a strategy class under (MultiWorkerMirroredStrategy is a
    CollectiveAllReduceStrategy), else the class name."""
    names = vars(cls).get("_tf_api_names") or ()
    return names[0].rsplit(".", 1)[-1] if names else cls.__name__


def replica_budget(config: Config, replica: Replica) -> Budget | None:
    """The budget one replica's program is rewritten to: the config's `memory_budget`
    (per replica), else its device's share (`tfmem.budget.device_budget`): on CPU the
    process's allocator is split evenly between the CPU devices the strategy uses here.

    Example:
        >>> strategy = tf.distribute.MirroredStrategy(split_cpu(2))
        >>> replica = strategy.experimental_local_results(strategy.run(current_replica))[1]
        >>> replica.device, replica.local_devices
        ('/job:localhost/replica:0/task:0/device:CPU:1', ('/job:localhost/replica:0/task:0/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1'))
        >>> replica_budget(Config(memory_budget="512MiB"), replica)   # the config's, per replica
        Budget(nbytes=536870912, source='config')
    """
    on_cpu = tf.DeviceSpec.from_string(replica.device).device_type == "CPU"
    sharing = sum(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in replica.local_devices) if on_cpu else 1
    return resolve_budget(config, replica.device, sharing=max(1, sharing))


def split_cpu(count: int) -> list[str]:
    """Splits the host's CPU into `count` logical devices, e.g. to try `MirroredStrategy` on CPU.

    Call it before TensorFlow runs anything (TF fixes its devices on first use). The
    logical devices share the CPU's cores and its one memory allocator.

    Example (in a fresh process; calling it again with the same count is harmless):
        >>> split_cpu(2)
        ['/cpu:0', '/cpu:1']
        >>> strategy = tf.distribute.MirroredStrategy(split_cpu(2))
        >>> strategy.num_replicas_in_sync
        2
        >>> split_cpu(3)            # too late: TensorFlow has initialised its devices
        Traceback (most recent call last):
        ...
        RuntimeError: Virtual devices cannot be modified after being initialized

    Raises:
        RuntimeError: if TensorFlow has already initialised its devices.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [f"/cpu:{i}" for i in range(count)]
