"""Plans kept between processes (`Config.plan_cache`): a second run rewrites nothing.

A plan is what `compile_within_budget` decided for one signature: the rewritten graph,
the records, the verdict and, when XLA was asked, its plan. It depends on the traced graph,
the config, the budget (and so the device and what its allocator held) and the versions
of tfmem and TensorFlow; the file's name is a hash of all of them, so a plan is found
again exactly when nothing changed, and never otherwise. Files are JSON (the graph as
base64 of its serialised GraphDef): reading one runs no code.

XLA's own compilation is not in the plan; TensorFlow keeps it between processes with
`TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=DIR` (set before TensorFlow starts).

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     cache = PlanCache(directory)
    ...     key = cache.key("digest of the traced graph", Config(memory_budget="1GiB"), Budget(2**30, "config"))
    ...     len(key), cache.path(key).endswith(".json")
    (64, True)
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from tfmem.budget import NOTHING_HELD, Budget, Held, PlanVerdict
from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.graph import Graph
from tfmem.memory import XlaPlan, estimate_memory
from tfmem.passes import RewriteRecord, collector_paused

logger = logging.getLogger(__name__)

# Bumped whenever what a plan file holds, or what it means, changes (4: the allocator's
# bytes in use beside its peak, and an overshoot that counts them).
FORMAT = 4


@dataclasses.dataclass(frozen=True)
class PlanCache:
    """A directory of plans, one JSON file per (traced graph, config, budget, versions)."""

    directory: str

    def key(self, graph_digest: str, config: Config, budget: Budget | None, pipeline: Sequence[str] = ()) -> str:
        """The name of a plan: a hash of everything the plan depends on (`pipeline`: the
        passes that run, by class, as registered pipelines may differ between processes)."""
        import tensorflow as tf

        import tfmem
        from tfmem.xla_heaps import requested_heap_bytes

        devices = sorted(d.device_type for d in tf.config.list_physical_devices())
        # XLA's heap limit is the process's (tfmem.xla_heaps): a plan made under another differs.
        parts = [FORMAT, tfmem.__version__, tf.__version__, graph_digest,
                 repr(dataclasses.replace(config, plan_cache=None)),
                 None if budget is None else [budget.nbytes, budget.source], devices, list(pipeline),
                 requested_heap_bytes()]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()

    def path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.json")

    def load(self, key: str, traced: Any, config: Config, budget: Budget | None) -> tuple[Any, dict[str, Any]] | None:
        """The cached `Rewritten` stage for `traced`, and what XLA was found to plan, or None.

        A file that cannot be read (another version, a partial write) counts as absent.
        """
        from tfmem.stages import Rewritten

        path = self.path(key)
        if not os.path.exists(path):
            return None
        start = time.perf_counter()
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("format") != FORMAT:
                return None
            from tensorflow.core.framework import graph_pb2

            graph = Graph(graph_pb2.GraphDef.FromString(base64.b64decode(data["graph_def"])),
                          outputs=data["outputs"], keep=data["keep"])
            records = tuple(RewriteRecord(**{**r, "nodes": tuple(r["nodes"])}) for r in data["records"])
            verdict = PlanVerdict(**data["verdict"]) if data["verdict"] is not None else None
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.info("tfmem: ignoring the plan cache file %s: %s", path, err)
            return None
        context = PassContext.for_budget(config, budget)
        if data["target_bytes"] is not None:
            context = context.tightened(int(data["target_bytes"]))
        with collector_paused():
            memory = estimate_memory(graph)
        rewritten = Rewritten(traced=traced, context=context, graph=graph, records=records,
                              pass_seconds=data["pass_seconds"], memory=memory, verdict=verdict,
                              seconds=time.perf_counter() - start, cached=path)
        return rewritten, data["xla"]

    def store(self, key: str, compiled: Any) -> None:
        """Writes the plan of a `Compiled` stage (atomically: a reader never sees half a file)."""
        rewritten = compiled.rewritten
        plan = compiled.checked_plan
        data = {
            "format": FORMAT,
            "graph_def": base64.b64encode(rewritten.graph.to_graph_def().SerializeToString()).decode(),
            "outputs": [str(o) for o in rewritten.graph.outputs],
            "keep": sorted(rewritten.graph.keep),
            "records": [dataclasses.asdict(r) for r in rewritten.records],
            "verdict": dataclasses.asdict(rewritten.verdict) if rewritten.verdict is not None else None,
            "target_bytes": rewritten.context.target_bytes,
            "pass_seconds": dict(rewritten.pass_seconds),
            "xla": {"total_bytes": plan.total_bytes if plan is not None else None,
                    "largest_bytes": plan.largest_bytes if plan is not None else None,
                    "temp_bytes": plan.temp_bytes if plan is not None else None,
                    "output_bytes": plan.output_bytes if plan is not None else None,
                    "heap_bytes": list(plan.heap_bytes) if plan is not None else None,
                    "overshoot": compiled.xla_overshoot, "held_peak": compiled.held.peak,
                    "held_in_use": compiled.held.in_use},
        }
        os.makedirs(self.directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as f:
                json.dump(data, f, default=str)
            os.replace(temporary, self.path(key))
        except OSError:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise


def checked_plan(xla: dict[str, Any]) -> tuple[XlaPlan | None, float | None, Held]:
    """The XLA plan, its overshoot and what the allocator held then, as a plan file recorded
    them ((None, None, nothing held): XLA was not asked)."""
    if xla.get("total_bytes") is None:
        return None, None, NOTHING_HELD
    temp = xla.get("temp_bytes")
    return (XlaPlan(int(xla["total_bytes"]), int(xla["largest_bytes"]), temp_bytes=None if temp is None else int(temp),
                    output_bytes=int(xla.get("output_bytes") or 0),
                    heap_bytes=tuple(int(h) for h in xla.get("heap_bytes") or ())),
            xla.get("overshoot"),
            Held(int(xla.get("held_in_use") or 0), int(xla.get("held_peak") or 0)))
