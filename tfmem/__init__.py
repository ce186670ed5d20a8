"""tfmem: memory-safe TensorFlow through graph rewrites.

Wrap a function as you would with `tf.function`; tfmem traces it, rewrites its graph so
that no tensor exceeds the configured limits, and runs the result under XLA.

Example:
    >>> import tfmem, tensorflow as tf
    >>> @tfmem.function(config={"tensor_size_threshold": "64MB"})
    ... def f(x, y):
    ...     return tf.reduce_sum((x[:, None] - y[None]) ** 2, -1)
    >>> print(tfmem.explain(f, tf.ones([4000, 64]), tf.ones([4000, 64])))
"""
from __future__ import annotations

import logging as _logging

from tfmem._lazy import lazy_exports as _lazy_exports

# Public name → the module that defines it. Loaded on first use, so that `import tfmem`
# (and the `tfmem` command, which must set TensorFlow's log level first) does not pull
# in TensorFlow before it is needed.
_EXPORTS = {
    "UnsupportedFunction": "capture",
    **dict.fromkeys(["Budget", "device_budget", "resolve_budget"], "budget"),
    **dict.fromkeys(["TfmemError", "TfmemWarning"], "errors"),
    **dict.fromkeys(["Compiled", "Rewritten", "Traced"], "stages"),
    **dict.fromkeys(["PASS_STAGES", "Config", "active_config", "config_scope", "define_flags", "format_size",
                     "parse_size"], "config"),
    **dict.fromkeys(["Graph", "GraphError", "TensorRef"], "graph"),
    **dict.fromkeys(["IsolatedResult", "run_isolated"], "isolation"),
    **dict.fromkeys(["LiveTensor", "MemoryEstimate", "XlaPlan", "estimate_memory", "xla_plan", "xla_planned_bytes"], "memory"),
    **dict.fromkeys(["GraphPass", "PassError", "PassManager", "PassResult", "PipelineResult", "RewriteRecord",
                     "register_pipeline"], "passes"),
    **dict.fromkeys(["Match", "Pattern", "RewriteRule", "RuleSet"], "pattern"),
    "PassContext": "context",
    "PlanCache": "plan_cache",
    "Report": "report",
    **dict.fromkeys(["TfmemFunction", "explain", "function"], "wrapper"),
    "limit_xla_heaps": "xla_heaps",
}


__getattr__, __dir__ = _lazy_exports(__name__, {name: f"tfmem.{module}" for name, module in _EXPORTS.items()})

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__version__ = "0.1.0"
__all__ = sorted(_EXPORTS)
