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

from tfmem.capture import UnsupportedFunction
from tfmem.config import PASS_STAGES, Config, active_config, config_scope, define_flags, format_size, parse_size
from tfmem.graph import Graph, GraphError, TensorRef
from tfmem.isolation import IsolatedResult, run_isolated
from tfmem.memory import LiveTensor, MemoryEstimate, estimate_memory, xla_planned_bytes
from tfmem.passes import GraphPass, PassError, PassManager, PassResult, PipelineResult, RewriteRecord
from tfmem.pattern import Match, Pattern, RewriteRule, RuleSet
from tfmem.report import Report
from tfmem.wrapper import TfmemError, TfmemFunction, explain, function

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__version__ = "0.1.0"
__all__ = [
    "PASS_STAGES", "Config", "Graph", "GraphError", "GraphPass", "IsolatedResult", "LiveTensor",
    "MemoryEstimate", "PassError", "PassManager", "PassResult", "PipelineResult", "Report",
    "RewriteRecord", "TensorRef", "TfmemError", "TfmemFunction", "UnsupportedFunction",
    "active_config", "config_scope", "define_flags", "estimate_memory", "explain", "format_size",
    "function", "parse_size", "run_isolated", "xla_planned_bytes",
    "Match", "Pattern", "RewriteRule", "RuleSet",
]
