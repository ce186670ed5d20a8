"""Data-parallel GPflow training with `tf.distribute`, each replica's program through tfmem.

tfmem does not distribute anything itself: the strategy (MirroredStrategy on one
host's devices, MultiWorkerMirroredStrategy across hosts) runs one replica per device
and does the communication; tfmem rewrites each replica's program to fit that
replica's memory budget (`tfmem.distribute`).

- `DataParallelSGPR`: GPflow's SGPR, full batch. Each replica holds a contiguous shard
  of the data and computes the bound's data-dependent sums over it (`SGPRStatistics`,
  inside tfmem's split loops when its budget needs them); the strategy all-reduces
  them; every replica then runs the small [M, M] algebra on the reduced sums
  (`collapsed_elbo`). The result is GPflow's `model.elbo()`, up to summation order.
- `DataParallelSVGP`: GPflow's SVGP on minibatches; each replica takes its share of a
  global batch, the gradients are all-reduced, and the optimizer steps as one
  single-device step on the global batch would.

Gradients. With loss L computed identically on R replicas from all-reduced sums, the
gradient of the all-reduce is itself an all-reduce, so each replica's tape already
holds its shard's share of dL *times R*. Each replica therefore differentiates L / R,
and the strategy's sum over replicas (`apply_gradients`, or `loss_and_gradients`)
is exactly dL: nothing is counted twice.

Create the model (and a Keras optimizer) under `strategy.scope()`, so that their
variables are mirrored on every replica.

One strategy per process: a second `MirroredStrategy` over the same devices numbers
its collectives (all-reduces) from the same keys as the first, and TensorFlow aborts
them ("Shape mismatch in the collective instance 100"). The examples here share one
`strategy` made when the program starts: two replicas on one CPU,
`tf.distribute.MirroredStrategy(tfmem.distribute.split_cpu(2))` (`split_cpu` must run
before TensorFlow initialises its devices).

Example:
    >>> strategy.extended.worker_devices
    ('/job:localhost/replica:0/task:0/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1')
    >>> with strategy.scope():
    ...     model = gpflow.models.SGPR((X, Y), gpflow.kernels.SquaredExponential(), Z)
    ...     adam = tf.keras.optimizers.Adam(0.01)
    >>> sgpr = DataParallelSGPR(model, strategy, config={"tensor_size_threshold": "64MiB",
    ...                                                  "memory_budget": "512MiB"})
    >>> bool(np.isclose(sgpr.elbo(), model.elbo()))   # each replica summing half the data
    True
    >>> step = sgpr.training_step(adam)
    >>> losses = [float(step()) for _ in range(100)]
    >>> losses[-1] < losses[0]
    True
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import gpflow
import numpy as np
import tensorflow as tf
from gpflow.config import default_float, default_jitter
from gpflow.covariances import Kuf, Kuu
from gpflow.utilities import add_noise_cov

import tfmem
from gpflow_integration.optimizers import ConfigLike, _build_optimizer

logger = logging.getLogger(__name__)


class SGPRStatistics(NamedTuple):
    """The sums over data points that GPflow's SGPR bound needs; summed over shards they are the whole.

    With L Lᵀ = Kuu, σ² the noise variance at each point, A = L⁻¹ Kuf / σ and
    e = (y − m(x)) / σ, over the points of one shard:
    """

    AAT: tf.Tensor  # [M, M]   A Aᵀ
    Aerr: tf.Tensor  # [M, P]  A e
    trace_k: tf.Tensor  # []   Σ k(x, x) / σ²
    log_sigma_sq: tf.Tensor  # []  Σ log σ²
    err_inner: tf.Tensor  # []  Σ e²
    num_data: tf.Tensor  # []  the number of points


def sgpr_statistics(model: gpflow.models.SGPR, X: tf.Tensor, Y: tf.Tensor) -> SGPRStatistics:  # noqa: N803
    """The data-dependent sums of `model`'s bound over the points (X [n, D], Y [n, P]).

    The same intermediates as GPflow 2.11's `SGPR._common_calculation`, `logdet_term`
    and `quad_term` (gpflow/models/sgpr.py), with each sum over data points kept
    separate, so that shards can be summed.
    """
    iv = model.inducing_variable
    sigma_sq = tf.squeeze(model.likelihood.variance_at(X), axis=-1)  # [n]
    sigma = tf.sqrt(sigma_sq)  # [n]
    kuf = Kuf(iv, model.kernel, X)  # [M, n]
    kuu = Kuu(iv, model.kernel, jitter=default_jitter())  # [M, M]
    L = tf.linalg.cholesky(kuu)  # [M, M]
    A = tf.linalg.triangular_solve(L, kuf / sigma, lower=True)  # [M, n]
    err = (Y - model.mean_function(X)) / sigma[..., None]  # [n, P]
    kdiag = model.kernel(X, full_cov=False)  # [n]
    return SGPRStatistics(
        AAT=tf.linalg.matmul(A, A, transpose_b=True),
        Aerr=tf.linalg.matmul(A, err),
        trace_k=tf.reduce_sum(kdiag / sigma_sq),
        log_sigma_sq=tf.reduce_sum(tf.math.log(sigma_sq)),
        err_inner=tf.reduce_sum(tf.square(err)),
        num_data=tf.cast(tf.shape(X)[0], default_float()),
    )


def collapsed_elbo(stats: SGPRStatistics, num_outputs: int) -> tf.Tensor:
    """GPflow's SGPR bound (Titsias 2009) from the data statistics of *all* the data.

    Restates GPflow 2.11's `SGPR.elbo` = const + `logdet_term` + `quad_term`
    (gpflow/models/sgpr.py) on the summed statistics; only [M, M] algebra is left.
    """
    dtype = stats.AAT.dtype
    P = tf.cast(num_outputs, dtype)  # noqa: N806 - GPflow's name
    B = add_noise_cov(stats.AAT, tf.cast(1.0, dtype))  # [M, M]
    LB = tf.linalg.cholesky(B)  # [M, M]
    trace = stats.trace_k - tf.reduce_sum(tf.linalg.diag_part(stats.AAT))  # tr(K − Q) / σ²
    half_logdet_b = tf.reduce_sum(tf.math.log(tf.linalg.diag_part(LB)))
    logdet = -P * (half_logdet_b + 0.5 * stats.log_sigma_sq + 0.5 * trace)
    c = tf.linalg.triangular_solve(LB, stats.Aerr, lower=True)  # [M, P]
    quad = -0.5 * (stats.err_inner - tf.reduce_sum(tf.square(c)))
    const = -0.5 * stats.num_data * P * np.log(2 * np.pi)
    return const + logdet + quad


def shard_rows(strategy: tf.distribute.Strategy, *arrays: Any) -> tuple[Any, ...]:
    """Splits each array along its first axis into one contiguous shard per replica.

    Each shard is created on its replica's device (a per-replica value); shard sizes
    differ by at most one row. Under MultiWorkerMirroredStrategy every worker passes
    the same arrays and keeps only its own replicas' shards.

    Example:
        >>> X_shards, Y_shards = shard_rows(strategy, X, Y)           # X: [200, 3]
        >>> [x.shape[0] for x in strategy.experimental_local_results(X_shards)]
        [100, 100]
    """
    dtype = default_float()
    arrays = tuple(np.asarray(a) for a in arrays)
    rows = arrays[0].shape[0]
    if any(a.shape[0] != rows for a in arrays):
        raise ValueError(f"arrays have different numbers of rows: {[a.shape[0] for a in arrays]}")
    replicas = strategy.num_replicas_in_sync
    if rows < replicas:
        raise ValueError(f"{rows} rows cannot be shared by {replicas} replicas")
    bounds = np.linspace(0, rows, replicas + 1).round().astype(int)

    def shard(index: int) -> Callable[[tf.distribute.experimental.ValueContext], tf.Tensor]:
        def value(context: tf.distribute.experimental.ValueContext) -> tf.Tensor:
            replica = context.replica_id_in_sync_group
            rows = tf.constant(arrays[index][bounds[replica]:bounds[replica + 1]],
                               dtype=dtype if arrays[index].dtype.kind == "f" else None)
            # An eager tf.constant stays in host memory whatever the device scope; the
            # identity copies it to the replica's device once, not on every step.
            return tf.identity(rows)
        return value

    return tuple(strategy.experimental_distribute_values_from_function(shard(i)) for i in range(len(arrays)))


def _first_local(strategy: tf.distribute.Strategy, value: Any) -> Any:
    """The value of this worker's first replica (all replicas hold the same value)."""
    return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], value)


class _DataParallel:
    """What both models share: the strategy, the variables, the training step."""

    def __init__(self, model: gpflow.models.GPModel, strategy: tf.distribute.Strategy,
                 variables: Sequence[tf.Variable] | None) -> None:
        self.model = model
        self.strategy = strategy
        self.variables = tuple(model.trainable_variables if variables is None else variables)
        unmirrored = [v.name for v in self.variables if not isinstance(v, tf.distribute.DistributedValues)]
        if unmirrored and strategy.num_replicas_in_sync > 1:
            raise ValueError(f"variables {unmirrored} are not mirrored: create the model under "
                             "`with strategy.scope():`")

    def _replica_gradients(self, loss_fn: Callable[[], tf.Tensor]) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """(loss, this replica's gradients of loss / R): summed over replicas, the gradients of loss."""
        replicas = self.strategy.num_replicas_in_sync
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(self.variables)
            loss = loss_fn()
            scaled = loss / replicas
        grads = tape.gradient(scaled, self.variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return loss, grads

    def _step(self, optimizer: Any, loss_fn: Callable[..., tf.Tensor]) -> Callable[..., tf.Tensor]:
        with self.strategy.scope():
            _build_optimizer(optimizer, self.variables)

        def replica_step(*args: tf.Tensor) -> tf.Tensor:
            loss, grads = self._replica_gradients(lambda: loss_fn(*args))
            optimizer.apply_gradients(zip(grads, self.variables))  # sums the replicas' gradients
            return loss

        @tf.function(autograph=False)
        def step(*args: Any) -> tf.Tensor:
            return _first_local(self.strategy, self.strategy.run(replica_step, args))

        return step


class DataParallelSGPR(_DataParallel):
    """GPflow's SGPR trained full-batch on every replica of a `tf.distribute` strategy.

    Args:
        model: a `gpflow.models.SGPR` created under `strategy.scope()`. Its parameters
            are used as they are; its own copy of the data is not read when `data` is given.
        strategy: e.g. `tf.distribute.MirroredStrategy(["/gpu:0", "/gpu:1"])`.
        data: (X [N, D], Y [N, P]) to shard over the replicas; defaults to `model.data`.
        config: the tfmem config of each replica's statistics (a `tfmem.Config`, mapping
            or YAML path). Its `memory_budget` is *per replica*; without one a replica
            uses its device's budget (see `tfmem.distribute`).
        variables: what to train; defaults to `model.trainable_variables`.
        jit_compile: overrides the config's `jit_compile`.

    Example:
        >>> with strategy.scope():
        ...     model = gpflow.models.SGPR((X, Y), gpflow.kernels.SquaredExponential(), Z)
        >>> sgpr = DataParallelSGPR(model, strategy, config={"tensor_size_threshold": "64MiB",
        ...                                                  "memory_budget": "256MiB"})
        >>> loss, grads = sgpr.loss_and_gradients()    # model.training_loss() and its gradients
        >>> bool(np.isclose(loss, model.training_loss())), len(grads) == len(model.trainable_variables)
        (True, True)
        >>> report = sgpr.reports()[0]                 # replica 0's rewrite and budget
        >>> print(report.function_name + report.signature + report.where)
        sgpr_statistics(float64[100, 3], float64[100, 1]) under MirroredStrategy replica 0 of 2 on /job:localhost/replica:0/task:0/device:CPU:0
        >>> print(report.budget)
        256.0 MiB (config)
    """

    def __init__(self, model: gpflow.models.SGPR, strategy: tf.distribute.Strategy, *,
                 data: tuple[Any, Any] | None = None, config: ConfigLike = None,
                 variables: Sequence[tf.Variable] | None = None, jit_compile: bool | None = None) -> None:
        if not isinstance(model, gpflow.models.SGPR):
            raise TypeError(f"expected a gpflow.models.SGPR, got {type(model).__name__}")
        super().__init__(model, strategy, variables)
        X, Y = model.data if data is None else data  # noqa: N806 - GPflow's names
        self.num_outputs = int(np.shape(Y)[-1])
        self.X, self.Y = shard_rows(strategy, X, Y)  # noqa: N806
        self.statistics = tfmem.function(lambda X, Y: sgpr_statistics(model, X, Y),  # noqa: N803
                                         config=tfmem.Config.coerce(config), jit_compile=jit_compile,
                                         name="sgpr_statistics")
        self._elbo = tf.function(lambda X, Y: _first_local(strategy, strategy.run(self._replica_elbo, (X, Y))),  # noqa: N803
                                 autograph=False)
        self._loss_and_gradients = tf.function(self._run_loss_and_gradients, autograph=False)

    def _replica_elbo(self, X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803
        """In one replica: its shard's statistics, all-reduced, then the bound."""
        local = self.statistics(X, Y)
        total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)
        return collapsed_elbo(SGPRStatistics(*total), self.num_outputs)

    def _replica_loss(self, X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803
        """GPflow's `training_loss`: −(ELBO + log prior density of the parameters)."""
        return -(self._replica_elbo(X, Y) + self.model.log_prior_density())

    def elbo(self) -> tf.Tensor:
        """The bound on all the data: `model.elbo()`, computed data-parallel."""
        return self._elbo(self.X, self.Y)

    def _run_loss_and_gradients(self, X: Any, Y: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:  # noqa: N803
        def replica(X: tf.Tensor, Y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:  # noqa: N803
            loss, grads = self._replica_gradients(lambda: self._replica_loss(X, Y))
            return loss, tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)

        return _first_local(self.strategy, self.strategy.run(replica, (X, Y)))

    def loss_and_gradients(self) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """`model.training_loss()` and its gradients with respect to `variables`, computed data-parallel."""
        return self._loss_and_gradients(self.X, self.Y)

    def training_step(self, optimizer: Any) -> Callable[[], tf.Tensor]:
        """One optimizer step on all the data; each call returns the loss before the update.

        `optimizer` (e.g. `tf.keras.optimizers.Adam`) must be created under `strategy.scope()`.

        Example:
            >>> with strategy.scope():
            ...     model = gpflow.models.SGPR((X, Y), gpflow.kernels.SquaredExponential(), Z)
            ...     adam = tf.keras.optimizers.Adam(0.01)
            >>> step = DataParallelSGPR(model, strategy).training_step(adam)
            >>> first = float(step())
            >>> for _ in range(20):
            ...     loss = step()
            >>> float(loss) < first
            True
        """
        step = self._step(optimizer, self._replica_loss)
        return lambda: step(self.X, self.Y)

    def reports(self) -> list[tfmem.Report]:
        """tfmem's report of each replica's statistics program and of its gradient (`sgpr_statistics_vjp`)."""
        return self.statistics.reports()


class DataParallelSVGP(_DataParallel):
    """GPflow's SVGP trained on minibatches split across the replicas of a strategy.

    A step takes a *global* batch as per-replica shards (`strategy.experimental_distribute_dataset`
    of a dataset batched to the global size, or `shard_rows`). Each replica evaluates
    `model.elbo` on its shard through tfmem; GPflow scales a shard of b/R points by
    num_data·R/b, so the mean of the replicas' ELBOs is the ELBO of the global batch,
    and the summed gradients of ELBO/R are its gradients.

    Args:
        model: a `gpflow.models.SVGP` created under `strategy.scope()`, with `num_data` set.
        strategy, config, variables, jit_compile: as for `DataParallelSGPR`.

    Example:
        >>> with strategy.scope():
        ...     svgp = gpflow.models.SVGP(gpflow.kernels.SquaredExponential(), gpflow.likelihoods.Gaussian(),
        ...                               Z, num_data=N)
        ...     adam = tf.keras.optimizers.Adam(0.01)
        >>> batches = strategy.experimental_distribute_dataset(   # global batches of 100, 50 per replica
        ...     tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(100, drop_remainder=True))
        >>> step = DataParallelSVGP(svgp, strategy).training_step(adam)
        >>> losses = [float(step(*batch)) for batch, _ in zip(batches, range(100))]
        >>> losses[-1] < losses[0]
        True
    """

    def __init__(self, model: gpflow.models.SVGP, strategy: tf.distribute.Strategy, *,
                 config: ConfigLike = None, variables: Sequence[tf.Variable] | None = None,
                 jit_compile: bool | None = None) -> None:
        if not isinstance(model, gpflow.models.SVGP):
            raise TypeError(f"expected a gpflow.models.SVGP, got {type(model).__name__}")
        if model.num_data is None:
            raise ValueError("set the SVGP's num_data: a replica's shard is a minibatch, and GPflow "
                             "scales its ELBO by num_data / batch size")
        super().__init__(model, strategy, variables)
        self.local_elbo = tfmem.function(lambda X, Y: model.elbo((X, Y)),  # noqa: N803
                                         config=tfmem.Config.coerce(config), jit_compile=jit_compile,
                                         name="svgp_elbo")
        self._elbo = tf.function(self._run_elbo, autograph=False)
        self._loss_and_gradients = tf.function(self._run_loss_and_gradients, autograph=False)

    def _global_elbo(self, X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803
        """In one replica: the ELBO of the global batch (the mean of the replicas' shard ELBOs)."""
        local = self.local_elbo(X, Y)
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, local)

    def _replica_loss(self, X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803
        """GPflow's `training_loss` of the global batch: −(ELBO + log prior density)."""
        return -(self._global_elbo(X, Y) + self.model.log_prior_density())

    def _run_elbo(self, X: Any, Y: Any) -> tf.Tensor:  # noqa: N803
        return _first_local(self.strategy, self.strategy.run(self._global_elbo, (X, Y)))

    def elbo(self, X: Any, Y: Any) -> tf.Tensor:  # noqa: N803
        """`model.elbo` of the global batch whose per-replica shards are X and Y."""
        return self._elbo(X, Y)

    def _run_loss_and_gradients(self, X: Any, Y: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:  # noqa: N803
        def replica(X: tf.Tensor, Y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:  # noqa: N803
            loss, grads = self._replica_gradients(lambda: self._replica_loss(X, Y))
            return loss, tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)

        return _first_local(self.strategy, self.strategy.run(replica, (X, Y)))

    def loss_and_gradients(self, X: Any, Y: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:  # noqa: N803
        """`model.training_loss((X, Y))` of the global batch and its gradients with respect to `variables`."""
        return self._loss_and_gradients(X, Y)

    def training_step(self, optimizer: Any) -> Callable[[Any, Any], tf.Tensor]:
        """One optimizer step on a global batch given as per-replica shards: `step(X, Y)`.

        Returns the loss (`model.training_loss` of the global batch) before the update.
        """
        return self._step(optimizer, self._replica_loss)

    def reports(self) -> list[tfmem.Report]:
        """tfmem's report of each replica's ELBO program and of its gradient (`svgp_elbo_vjp`)."""
        return self.local_elbo.reports()
