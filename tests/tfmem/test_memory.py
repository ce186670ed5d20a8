"""Memory accounting: static peaks checked by hand, While bodies, XLA's plan, real OOMs."""
from __future__ import annotations

import pytest
import tensorflow as tf

import tfmem
from tests import background
from tfmem import Graph, TensorRef, estimate_memory, run_isolated, xla_planned_bytes
from tfmem.allocator import Allocate
from tfmem.memory import while_passthrough


def graph_of(fn, *specs) -> Graph:
    concrete = tf.function(fn).get_concrete_function(*specs)
    return Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])


def _chain(x):
    a = tf.exp(x)
    b = tf.sin(a)
    return tf.reduce_sum(a + b)


def _matmul_rowsum(x, y):
    return tf.reduce_sum(x @ y, axis=1)


def _reshape_alias(x):
    return tf.sin(tf.reshape(tf.exp(x), [100]))


@pytest.mark.parametrize("fn, specs, peak, node_op, live", [
    # x, exp, sin and add live together, plus the 4-byte reduction axis constant.
    (_chain, [tf.TensorSpec([1000], tf.float32)], 4 * 4000 + 4, "AddV2", 5),
    # x, y, the [100, 100] product and the [100] row sums at the Sum; + the axis constant.
    (_matmul_rowsum, [tf.TensorSpec([100, 50], tf.float64), tf.TensorSpec([50, 100], tf.float64)],
     40000 + 40000 + 80000 + 800 + 4, "Sum", 5),
    # Reshape allocates nothing: x, exp (kept alive through its reshape), sin, the shape constant.
    (_reshape_alias, [tf.TensorSpec([10, 10], tf.float32)], 400 + 400 + 400 + 4, "Sin", 4),
])
def test_static_peak_matches_hand_count(fn, specs, peak: int, node_op: str, live: int) -> None:
    graph = graph_of(fn, *specs)
    estimate = estimate_memory(graph)
    assert estimate.peak_bytes == peak
    assert graph.node(estimate.peak_node).op == node_op
    assert len(estimate.live_at_peak) == live
    assert sum(t.nbytes for t in estimate.live_at_peak) == peak
    assert estimate.unknown == ()


def _mask_for_a_late_reader(x):  # x: [n, n] float32
    n = x.shape[0]
    a = tf.exp(x)
    total = tf.reduce_sum(a @ a + a)  # x, a, a @ a and their sum live together: the peak
    mask = tf.equal(tf.range(n)[:, None], tf.range(n)[None, :])  # [n, n] from constants alone
    return tf.where(mask, tf.sin(x * total), 0.0)  # its reader waits for the product


def test_a_large_tensor_made_from_constants_is_made_just_before_its_reader() -> None:
    # Scheduled by new bytes alone, the mask (a quarter of a float32 matrix) would run
    # first, the smallest allocation, and be held across the product; made when its reader
    # is otherwise ready, the peak is the four float32 matrices around the product.
    n = 1100  # the mask: 1.2 MiB, over what is left to XLA to make (`LARGE_TENSOR_BYTES`)
    estimate = estimate_memory(graph_of(_mask_for_a_late_reader, tf.TensorSpec([n, n], tf.float32)))
    assert all(t.dtype != "bool" for t in estimate.live_at_peak), estimate.in_words()
    assert 4 * 4 * n * n <= estimate.peak_bytes < 4 * 4 * n * n + n * n


def test_while_counts_its_body_peak() -> None:
    def fn(x):
        def body(i, acc):
            big = tf.exp(tf.tile(x, [100]))  # [10000] float32 = 40 kB inside the loop only
            return i + 1, acc + tf.reduce_sum(big)
        return tf.while_loop(lambda i, acc: i < 3, body, (0, 0.0))[1]

    graph = graph_of(fn, tf.TensorSpec([100], tf.float32))
    estimate = estimate_memory(graph)
    assert graph.node(estimate.peak_node).op in ("While", "StatelessWhile")
    assert estimate.nested_peak_bytes >= 2 * 40000  # tile and exp live together in the body
    assert estimate.peak_bytes >= estimate.nested_peak_bytes + 400


def _cond_in_a_loop(x, flag):
    def body(i, acc):
        inner = tf.cond(flag, lambda: tf.reduce_sum(tf.exp(x[:, None] * x[None, :])), lambda: tf.reduce_sum(x))
        return i + 1, acc + inner
    return tf.reduce_sum(tf.sin(x)) + tf.while_loop(lambda i, acc: i < 3, body, (0, 0.0))[1]


@pytest.mark.parametrize("fn, specs", [
    (_chain, [tf.TensorSpec([1000], tf.float32)]),
    (_reshape_alias, [tf.TensorSpec([10, 10], tf.float32)]),
    (_cond_in_a_loop, [tf.TensorSpec([300], tf.float32), tf.TensorSpec([], tf.bool)]),
])
def test_the_estimates_allocations_add_up_to_its_peak_each_one_freed_once(fn, specs) -> None:
    # What the allocator is replayed over (`tfmem.allocator`): live bytes at their most are
    # the estimate's peak, with the bodies a loop and a branch run nested in their step.
    graph = graph_of(fn, *specs)
    estimate = estimate_memory(graph)
    live, most, held = 0, 0, set()
    for event in estimate.allocations:
        if isinstance(event, Allocate):
            assert event.name not in held, event
            held.add(event.name)
            live += event.nbytes
        else:
            held.remove(event.name)
            live -= next(e.nbytes for e in estimate.allocations if isinstance(e, Allocate) and e.name == event.name)
        most = max(most, live)
    assert most == estimate.peak_bytes
    # What is held at the end is the program's own (its inputs, constants, outputs): a
    # body's buffers are all freed by the end of the step that runs it.
    assert all(name.rsplit(":", 1)[0] in graph for name in held), held


def test_control_dependencies_order_the_walk() -> None:
    v = tf.Variable(tf.zeros([1000]))

    def fn(x):
        v.assign(tf.exp(x))  # the write must run; its input counts
        return tf.reduce_sum(x)

    graph = graph_of(fn, tf.TensorSpec([1000], tf.float32))
    assert estimate_memory(graph).peak_bytes >= 2 * 4000


def test_xla_planned_bytes_parsed() -> None:
    f = tf.function(lambda x: x @ tf.transpose(x), jit_compile=True)
    x = tf.ones([1000, 10])
    planned = xla_planned_bytes(f, x)
    assert 4_000_000 <= planned < 3 * 4_000_000  # the [1000, 1000] float32 result dominates
    wrapped = tfmem.function(lambda x: x @ tf.transpose(x), config=tfmem.Config(passes=[]))
    assert xla_planned_bytes(wrapped, x) == wrapped.compiled(x).xla_planned_bytes(x) >= 4_000_000
    assert xla_planned_bytes(tf.function(lambda x: x * 2), x) is None  # not jit-compiled


def test_xla_plan_names_the_largest_allocation_without_the_parameters() -> None:
    f = tf.function(lambda x: tf.reduce_sum(tf.exp(x @ tf.transpose(x)), 0), jit_compile=True)
    big_input = tf.ones([1000, 2000])  # 8 MB parameter: not an allocation the call makes
    plan = tfmem.xla_plan(f, big_input)
    assert plan.total_bytes >= 8_000_000 + 4_000_000
    assert 4_000_000 <= plan.largest_bytes < 8_000_000  # the [1000, 1000] temporary


def test_xlas_live_set_at_its_peak_names_the_tensorflow_ops_it_keeps() -> None:
    def two_products(x: tf.Tensor) -> tf.Tensor:
        gram = tf.matmul(x, x, transpose_b=True, name="gram")  # [1000, 1000], alive at the peak
        return tf.reduce_sum(tf.exp(gram) @ gram, 0)

    plan = tfmem.xla_plan(tf.function(two_products, jit_compile=True), tf.ones([1000, 10]))
    peak = plan.peak
    assert peak is not None and peak.peak_bytes <= plan.largest_bytes
    assert peak.peak_bytes == sum(t.nbytes for t in peak.live_at_peak)
    gram = [t for t in peak.live_at_peak if t.name.split("/")[-1] == "gram"]  # op_name: [function/]node
    assert gram and gram[0].shape == (1000, 1000) and gram[0].dtype == "float32" and gram[0].nbytes == 4_000_000
    assert peak.peak_bytes >= 2 * 4_000_000  # the product is formed while gram is still read
    assert "2 whole float32[1000, 1000]" in peak.in_words()


def test_xlas_peak_with_the_calls_other_allocations_counts_a_big_output_beside_the_block() -> None:
    # The [1000, 1000] output is an allocation of its own, alive beside XLA's block of
    # temporaries all call long: a peak in the block is that much higher in all.
    def gram_and_its_exp(x: tf.Tensor) -> tf.Tensor:
        gram = tf.matmul(x, x, transpose_b=True)
        return tf.exp(gram @ gram) + gram

    plan = tfmem.xla_plan(tf.function(gram_and_its_exp, jit_compile=True), tf.ones([1000, 10]))
    assert plan.output_bytes >= 4_000_000 and plan.peak is not None
    both = plan.peak_with_others
    assert both is not None and both.live_at_peak == plan.peak.live_at_peak
    # The whole block is held at the peak (it is allocated in one piece), beside the others.
    assert both.peak_bytes == plan.total_bytes >= plan.peak.peak_bytes + plan.total_bytes - plan.block_bytes
    assert both.peak_bytes >= plan.peak.peak_bytes + plan.output_bytes


def test_xlas_peak_counts_a_loop_state_updated_in_place_once() -> None:
    # acc += x_c x_cᵀ in a loop: the loop's state, the value its body writes back and the
    # loop's result are one [600, 600] buffer in XLA's block (its in-place update).
    def gram_by_chunks(x: tf.Tensor, lower: tf.Tensor) -> tf.Tensor:
        def body(i: tf.Tensor, acc: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            chunk = tf.linalg.triangular_solve(lower, tf.slice(x, [0, i * 100], [600, 100]), name="solved")
            return i + 1, acc + tf.matmul(chunk, chunk, transpose_b=True)
        _, gram = tf.while_loop(lambda i, _: i < 6, body, [0, tf.zeros([600, 600], tf.float64)])
        return tf.reduce_sum(tf.exp(gram), 0)

    lower = tf.linalg.cholesky(tf.eye(600, dtype=tf.float64) * 2.0)
    plan = tfmem.xla_plan(tf.function(gram_by_chunks, jit_compile=True), tf.ones([600, 600], tf.float64), lower)
    peak, whole = plan.peak, 600 * 600 * 8
    assert peak is not None and peak.peak_bytes <= plan.block_bytes
    # In the loop: the state once (not its body's update beside it), the chunk's product,
    # and what XLA makes of the solve.
    states = [t for t in peak.live_at_peak if t.nbytes == whole and "MatMul" not in t.name and "solved" not in t.name]
    assert len(states) == 1, peak.in_words()
    assert any("MatMul" in t.name and t.nbytes == whole for t in peak.live_at_peak)


def test_what_xla_makes_up_inside_an_expanded_op_is_named_by_that_op() -> None:
    from tensorflow.compiler.xla.service import hlo_pb2

    from tfmem.memory import _op_names

    f = tf.function(lambda lower, b: tf.linalg.triangular_solve(lower, b * 2.0, adjoint=True, name="solved"),
                    jit_compile=True)
    lower = tf.linalg.cholesky(tf.eye(600, dtype=tf.float64) * 2.0)
    proto = hlo_pb2.HloProto()
    proto.ParseFromString(f.experimental_get_compiler_ir(lower, tf.ones([600, 600], tf.float64))(
        stage="optimized_hlo_proto_serialized"))
    made_up = {name for name in _op_names(proto).values() if "(XLA's " in name}
    assert made_up and all(name.startswith("solved/MatrixTriangularSolve (XLA's ") for name in made_up)


def test_the_report_shows_xlas_peak_beside_the_estimate() -> None:
    f = tfmem.function(lambda x: tf.reduce_sum(tf.exp(x @ tf.transpose(x)) @ x, 0),
                       config=tfmem.Config(memory_budget="2MiB"))
    x = tf.ones([1000, 10])
    report = f.report(x)
    assert report.xla_plan_after is not None and report.xla_peak_after is not None
    text = str(report)
    assert "  XLA's peak:  peak " in text and "block)" in text


@background.job("allocate_under_limits")
def allocate_under_limits() -> tuple[tfmem.IsolatedResult, tfmem.IsolatedResult]:
    """16 MiB under a 256 MiB limit, and 256 MiB under 64 MiB, each in its own process."""
    return (run_isolated("tfmem.examples:allocate", 16, memory_limit_mb=256, timeout=120),
            run_isolated("tfmem.examples:allocate", 256, memory_limit_mb=64, timeout=120))


@pytest.mark.background("allocate_under_limits")
def test_isolated_run_reports_peak_and_real_oom() -> None:
    ok, oom = background.result("allocate_under_limits")
    assert ok.status == "ok", ok.error
    assert ok.value == pytest.approx(16 * 2**20 / 4)
    assert ok.peak_bytes >= 16 * 2**20
    assert oom.status == "oom", oom.error
    assert "ResourceExhausted" in oom.error or "OOM" in oom.error


def test_isolated_run_reports_errors_and_rejects_unimportable_targets() -> None:
    bad = run_isolated("tfmem.examples:allocate", "not a number", timeout=120)
    assert bad.status == "error" and "TypeError" in bad.error
    with pytest.raises(ValueError, match="module:function"):
        run_isolated("no_colon")
    with pytest.raises(ValueError, match="importable"):
        run_isolated(lambda: 1)


def test_loop_invariants_handed_back_allocate_nothing() -> None:
    def fn(x, big):
        # `big` is captured by the body, so the While takes it as a loop variable and returns it.
        return tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a + tf.reduce_sum(big)), (0, x))[1]

    graph = graph_of(fn, tf.TensorSpec([], tf.float32), tf.TensorSpec([1000], tf.float32))
    (loop,) = list(graph.find(("While", "StatelessWhile")))
    passed = while_passthrough(graph, loop.name)
    assert any(graph.spec(TensorRef(loop.name, i)).shape == [1000] for i in passed)
    # big (4000 B) is counted once, as an input, not again as the loop's output.
    assert estimate_memory(graph).peak_bytes < 2 * 4000


def _kernel_held_for_a_later_sum(x):
    k = tf.exp(x @ tf.transpose(x))  # [n, n], read again at the end
    kk = k @ k  # the peak: k and k @ k alive together
    return tf.reduce_sum(kk) + tf.reduce_sum(k)


def test_the_peak_names_what_keeps_each_tensor_alive_and_reads_as_whole_matrices() -> None:
    graph = graph_of(_kernel_held_for_a_later_sum, tf.TensorSpec([200, 3], tf.float64))
    estimate = estimate_memory(graph)
    by_op = {t.op: t for t in estimate.live_at_peak}
    kernel = by_op["Exp"]
    assert kernel.shape == (200, 200) and kernel.nbytes == 200 * 200 * 8
    # Its last reader keeps it alive, at or after the peak.
    assert kernel.held_for in {consumer for consumer, _ in graph.consumers(TensorRef(kernel.name.split(":")[0], 0))}
    assert estimate.at(kernel.held_for) and "(Exp)" in kernel.why()
    assert f"read later by {kernel.held_for}" in kernel.why() or kernel.held_for == estimate.peak_node
    assert kernel.why("elsewhere").endswith(f"read later by {kernel.held_for}")
    assert kernel.why(kernel.held_for).endswith("running at the peak")
    words = estimate.in_words()
    assert words.startswith(f"peak {tfmem.format_size(estimate.peak_bytes)} = ")
    assert "whole float64[200, 200]" in words


def test_a_tensor_held_to_the_end_says_so() -> None:
    graph = graph_of(lambda x: (tf.exp(x), tf.reduce_sum(tf.sin(x))), tf.TensorSpec([1000], tf.float64))
    (output,) = [t for t in estimate_memory(graph).live_at_peak if t.op == "Exp"]
    assert output.held_for == "" and output.why().endswith("held to the end")


def test_a_scatter_update_writes_into_its_dead_operand_as_xla_does() -> None:
    def accumulate(x):  # [4, 256, 1024] f64 = 8 MiB, updated block by block
        acc = x * 2.0
        for j in range(4):
            acc = tf.tensor_scatter_nd_add(acc, [[j]], acc[j:j + 1] * 2.0)
        return tf.reduce_sum(acc)

    graph = tfmem.TfmemFunction(accumulate).trace(tf.ones([4, 256, 1024], tf.float64)).graph
    estimate = estimate_memory(graph)
    block, whole = 256 * 1024 * 8, 4 * 256 * 1024 * 8
    # The input, the accumulator and one block's update (a slice and its double): not a
    # new accumulator per update (that would be 3 whole at the first scatter).
    assert estimate.peak_bytes < 2 * whole + 3 * block, estimate.peak_bytes / whole


def test_a_loop_whose_initial_state_nothing_reads_after_it_keeps_that_buffer() -> None:
    """XLA runs a `While` in its initial value's buffer when nothing reads that value after
    the loop: a loop that rewrites a matrix in place holds it once, not twice."""
    def rewrite_rows(x: tf.Tensor) -> tf.Tensor:  # x [1024, 1024] f64 = 8 MiB
        start = tf.exp(x)  # the loop's initial state, read by the loop only

        def body(i: tf.Tensor, a: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            rows = tf.slice(a, [i * 128, 0], [128, 1024])
            return i + 1, tf.tensor_scatter_nd_update(a, (i * 128 + tf.range(128))[:, None], rows * 2.0)

        return tf.reduce_sum(tf.while_loop(lambda i, _: i < 8, body, (0, start))[1])

    graph = graph_of(rewrite_rows, tf.TensorSpec([1024, 1024], tf.float64))
    whole = 1024 * 1024 * 8
    estimate = estimate_memory(graph)
    # x, the state, and the body's panels; not a second state for the loop's result.
    assert estimate.peak_bytes < 2.5 * whole, estimate.peak_bytes / whole
    xla = xla_planned_bytes(tf.function(rewrite_rows, jit_compile=True), tf.ones([1024, 1024], tf.float64))
    assert xla < 2.5 * whole, xla / whole  # what XLA plans agrees


def test_a_loop_whose_initial_state_is_read_after_it_gets_a_buffer_of_its_own() -> None:
    def rewrite_rows_and_keep(x: tf.Tensor) -> tf.Tensor:
        start = tf.exp(x)

        def body(i: tf.Tensor, a: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return i + 1, a * 2.0

        result = tf.while_loop(lambda i, _: i < 8, body, (0, start))[1]
        return tf.reduce_sum(result) + tf.reduce_sum(start)  # the initial value, read after the loop

    graph = graph_of(rewrite_rows_and_keep, tf.TensorSpec([1024, 1024], tf.float64))
    assert estimate_memory(graph).peak_bytes >= 3 * 1024 * 1024 * 8


def test_a_loop_body_is_estimated_with_the_functions_it_calls_alone(monkeypatch) -> None:
    """`function_graph` registers the functions a body calls (here a `tf.cond` in one loop),
    not the whole library (the other loop's): the same estimate, without importing every
    function of a program with many loops for each of them."""
    from tfmem import memory
    from tfmem.capture import capture

    def fn(x):
        def branchy(i, v):
            return i + 1, tf.cond(tf.reduce_sum(v) > 0, lambda: v @ x, lambda: v - 1.0)

        def plain(i, v):
            return i + 1, tf.tanh(v @ x)

        _, a = tf.while_loop(lambda i, v: i < 3, branchy, (0, x))
        _, b = tf.while_loop(lambda i, v: i < 3, plain, (0, x))
        return a + b

    graph = capture(tf.function(fn).get_concrete_function(tf.TensorSpec([64, 64], tf.float64))).to_graph()
    loops = [node for node in graph.nodes if node.op in ("While", "StatelessWhile")]
    bodies = {graph.node(node.name).attr["body"].func.name for node in loops}
    calls_cond = [name for name in bodies if any(n.op in ("If", "StatelessIf") for n in graph.function(name).node_def)]
    [with_cond] = calls_cond
    closure = {f.signature.name for f in memory._library_closure(graph.library, graph.function(with_cond)).function}
    branches = {f.signature.name for f in graph.library.function} - bodies - {
        graph.node(node.name).attr["cond"].func.name for node in loops}
    assert closure == branches and len(branches) == 2  # the cond's two branches, nothing of the other loop
    closed = estimate_memory(graph)
    monkeypatch.setattr(memory, "_library_closure", lambda library, fdef: library)
    whole = estimate_memory(graph)
    assert (closed.peak_bytes, closed.peak_node) == (whole.peak_bytes, whole.peak_node)


def test_ops_the_estimate_cannot_size_are_found_in_loop_bodies_too() -> None:
    """Programs with these are never judged by the estimate alone (`compile_within_budget`):
    XLA's expansions of special functions (betainc: 2.35× the estimate in fuzz 14) and the
    TensorLists a loop's gradient keeps, here inside a `map_fn` body's own loop."""
    from tfmem.memory import TENSOR_LIST_OPS, ops_in, xla_expanded_ops

    @tf.function
    def program(a: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
        def row(r: tf.Tensor) -> tf.Tensor:
            return tf.reduce_sum(tf.math.betainc(a, a, r))
        return tf.map_fn(row, x)

    spec = tf.TensorSpec([3, 4], tf.float64)
    graph = tfmem.Graph(program.get_concrete_function(tf.TensorSpec([4], tf.float64), spec).graph.as_graph_def())
    assert xla_expanded_ops(graph) == ["Betainc"]
    assert ops_in(graph, TENSOR_LIST_OPS)
    plain = tf.function(lambda x: tf.reduce_sum(x * x)).get_concrete_function(spec).graph.as_graph_def()
    assert ops_in(tfmem.Graph(plain), TENSOR_LIST_OPS | tfmem.memory.XLA_EXPANDED_OPS) == []
