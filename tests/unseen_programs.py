"""GP programs written by a fuzzing round (issue 19, round 11) as a researcher writes them,
not for any rule of tfmem: Cholesky solves and log-determinants with gradients, batched
factors, TFP and `tf.linalg.LinearOperator`, loops that hold a kernel matrix (conjugate
gradients, Newton, Jacobi, power iteration), inverses, eigh, QR, Hutchinson's estimator.

`tests/test_unseen_programs.py` checks that tfmem computes what stock XLA computes on each.
Each entry: name -> (build(n) -> (fn, args), small n, big n, budget in MiB, rtol); the
big size and budget are where stock XLA runs out of memory (`benchmarks/corpus` style).
"""
import numpy as np
import tensorflow as tf

F64 = tf.float64


def rbf(x, y, ls, var):
    xs, ys = x / ls, y / ls
    d = (tf.reduce_sum(xs ** 2, -1)[..., :, None] + tf.reduce_sum(ys ** 2, -1)[..., None, :]
         - 2.0 * tf.matmul(xs, ys, transpose_b=True))
    return var * tf.exp(-0.5 * tf.maximum(d, 0.0))


def data(n, d=3, seed=0, dtype=F64):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, size=(n, d))
    y = np.sin(x).sum(-1, keepdims=True) + 0.1 * rng.normal(size=(n, 1))
    return tf.constant(x, dtype), tf.constant(y, dtype)


# 1. exact GP marginal likelihood via cholesky + cholesky_solve, grads wrt ls, var, noise, X
def p_gp_nll_chol_solve(n):
    x, y = data(n, seed=1)
    ls = tf.constant([1.0, 0.8, 1.3], F64)
    var = tf.constant(1.5, F64)
    noise = tf.constant(0.1, F64)

    def fn(x, y, ls, var, noise):
        with tf.GradientTape() as tape:
            tape.watch([x, ls, var, noise])
            K = rbf(x, x, ls, var) + noise * tf.eye(tf.shape(x)[0], dtype=F64)
            L = tf.linalg.cholesky(K)
            alpha = tf.linalg.cholesky_solve(L, y)
            nll = 0.5 * tf.reduce_sum(y * alpha) + tf.reduce_sum(tf.math.log(tf.linalg.diag_part(L)))
        return nll, tape.gradient(nll, [x, ls, var, noise])
    return fn, (x, y, ls, var, noise)


# 2. float32, triangular_solve lower then adjoint, logdet via tf.linalg.logdet
def p_gp_f32_trisolve_adjoint(n):
    x, y = data(n, seed=2, dtype=tf.float32)
    ls = tf.constant(1.2, tf.float32)

    def fn(x, y, ls):
        with tf.GradientTape() as tape:
            tape.watch(ls)
            K = rbf(x, x, ls, 1.0) + 0.5 * tf.eye(tf.shape(x)[0])
            L = tf.linalg.cholesky(K)
            v = tf.linalg.triangular_solve(L, y, lower=True)
            a = tf.linalg.triangular_solve(L, v, lower=True, adjoint=True)
            loss = 0.5 * tf.reduce_sum(y * a) + 0.5 * tf.linalg.logdet(K)
        return loss, tape.gradient(loss, ls)
    return fn, (x, y, ls)


# 3. batched [b, n, n] kernels (one per output), logdet from chol diag, grads wrt lengthscales
def p_batched_chol_logdet(n):
    b = 4
    rng = np.random.default_rng(3)
    x = tf.constant(rng.uniform(-2, 2, size=(b, n, 2)), F64)
    y = tf.constant(rng.normal(size=(b, n, 1)), F64)
    ls = tf.constant([[0.5], [1.0], [1.5], [2.0]], F64)[:, :, None]  # [b,1,1]

    def fn(x, y, ls):
        with tf.GradientTape() as tape:
            tape.watch(ls)
            K = rbf(x, x, ls, 1.0) + 0.2 * tf.eye(n, batch_shape=[b], dtype=F64)
            L = tf.linalg.cholesky(K)
            a = tf.linalg.cholesky_solve(L, y)
            ll = -0.5 * tf.reduce_sum(y * a, [1, 2]) - tf.reduce_sum(tf.math.log(tf.linalg.diag_part(L)), -1)
            loss = -tf.reduce_sum(ll)
        return ll, tape.gradient(loss, ls)
    return fn, (x, y, ls)


# 4. tfp MultivariateNormalTriL log_prob with grads wrt ls and inputs
def p_tfp_mvn_tril(n):
    import tensorflow_probability as tfp
    x, y = data(n, seed=4)
    ls = tf.constant(0.9, F64)

    def fn(x, y, ls):
        with tf.GradientTape() as tape:
            tape.watch([ls, x])
            K = rbf(x, x, ls, 2.0) + 0.05 * tf.eye(tf.shape(x)[0], dtype=F64)
            mvn = tfp.distributions.MultivariateNormalTriL(loc=tf.zeros([tf.shape(x)[0]], F64),
                                                           scale_tril=tf.linalg.cholesky(K))
            lp = mvn.log_prob(y[:, 0])
        return lp, tape.gradient(lp, [ls, x])
    return fn, (x, y, ls)


# 5. LinearOperatorFullMatrix -> cholesky() -> solve / log_abs_determinant
def p_linop_chol(n):
    x, y = data(n, seed=5)
    ls = tf.constant(1.1, F64)

    def fn(x, y, ls):
        with tf.GradientTape() as tape:
            tape.watch(ls)
            K = rbf(x, x, ls, 1.0) + 0.3 * tf.eye(tf.shape(x)[0], dtype=F64)
            op = tf.linalg.LinearOperatorFullMatrix(K, is_self_adjoint=True, is_positive_definite=True)
            chol = op.cholesky()
            sol = chol.solve(y)
            quad = tf.reduce_sum(sol ** 2)
            loss = quad + chol.log_abs_determinant() * 2.0
        return loss, tape.gradient(loss, ls)
    return fn, (x, y, ls)


# 6. LinearOperatorLowerTriangular.solve + solvevec with adjoint, float32
def p_linop_lowertri_f32(n):
    x, y = data(n, seed=6, dtype=tf.float32)

    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            K = rbf(x, x, 1.0, 1.0) + 0.5 * tf.eye(tf.shape(x)[0])
            Lop = tf.linalg.LinearOperatorLowerTriangular(tf.linalg.cholesky(K))
            v = Lop.solvevec(y[:, 0])
            w = Lop.solvevec(v, adjoint=True)
            loss = tf.reduce_sum(w * y[:, 0]) + tf.reduce_sum(Lop.log_abs_determinant())
        return loss, tape.gradient(loss, x)
    return fn, (x, y)


# 14. Jacobi-preconditioned CG in `for i in tf.range(k)` with K built outside, gradient wrt ls through the loop
def p_pcg_grad(n):
    x, y = data(n, seed=14)
    ls = tf.constant(1.0, F64)

    def fn(x, y, ls):
        with tf.GradientTape() as tape:
            tape.watch(ls)
            K = rbf(x, x, ls, 1.0) + 2.0 * tf.eye(tf.shape(x)[0], dtype=F64)
            dinv = 1.0 / tf.linalg.diag_part(K)[:, None]
            sol, r = tf.zeros_like(y), y
            z = dinv * r
            p, rz = z, tf.reduce_sum(r * z)
            for _ in tf.range(10):
                Ap = K @ p
                a = rz / tf.reduce_sum(p * Ap)
                sol, r = sol + a * p, r - a * Ap
                z = dinv * r
                rz_new = tf.reduce_sum(r * z)
                p = z + (rz_new / rz) * p
                rz = rz_new
            loss = tf.reduce_sum(sol * y)
        return loss, tape.gradient(loss, ls)
    return fn, (x, y, ls)


# 15. Laplace approx. Newton iterations for GP classification, K held across tf.while_loop, chol inside
def p_laplace_newton(n):
    x, y = data(n, seed=15)
    t = tf.cast(y > 0, F64)

    def fn(x, t):
        K = rbf(x, x, 1.0, 2.0)
        N = tf.shape(x)[0]

        def body(i, f):
            pi = tf.sigmoid(f)
            W = pi * (1 - pi)
            sW = tf.sqrt(W)
            B = tf.eye(N, dtype=F64) + sW * K * tf.transpose(sW)
            L = tf.linalg.cholesky(B)
            b = W * f + (t - pi)
            a = b - sW * tf.linalg.cholesky_solve(L, sW * (K @ b))
            return i + 1, K @ a
        _, f = tf.while_loop(lambda i, f: i < 5, body, (0, tf.zeros_like(t)))
        return f, tf.reduce_sum(tf.math.log_sigmoid((2 * t - 1) * f))
    return fn, (x, t)


# 16. trace(K^-1 dK/dls) via matrix_inverse, as in a hand-derived GP gradient
def p_inverse_trace_grad(n):
    x, y = data(n, seed=16)
    ls = tf.constant(1.3, F64)

    def fn(x, y, ls):
        K = rbf(x, x, ls, 1.0) + 0.1 * tf.eye(tf.shape(x)[0], dtype=F64)
        Kinv = tf.linalg.inv(K)
        sq = tf.reduce_sum(x ** 2, -1)
        D = sq[:, None] + sq[None, :] - 2 * x @ tf.transpose(x)
        dK = (K - 0.1 * tf.eye(tf.shape(x)[0], dtype=F64)) * D / ls ** 3
        alpha = Kinv @ y
        grad = 0.5 * tf.reduce_sum(alpha * (dK @ alpha)) - 0.5 * tf.linalg.trace(Kinv @ dK)
        return grad, tf.reduce_sum(alpha)
    return fn, (x, y, ls)


# 17. eigh of a kernel matrix: log det from eigenvalues, top-k eigvecs, grads
def p_eigh_grad(n):
    x, _ = data(n, seed=17)
    ls = tf.constant(1.5, F64)

    def fn(x, ls):
        with tf.GradientTape() as tape:
            tape.watch(ls)
            K = rbf(x, x, ls, 1.0) + 0.1 * tf.eye(tf.shape(x)[0], dtype=F64)
            e, v = tf.linalg.eigh(K)
            loss = tf.reduce_sum(tf.math.log(e))
        return loss, tape.gradient(loss, ls), e[-5:]
    return fn, (x, ls)


# 18. matrix_solve + lstsq on a kernel matrix; grads wrt inputs via matrix_solve
def p_matrix_solve_lstsq(n):
    x, y = data(n, seed=18)

    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            K = rbf(x, x, 1.0, 1.0) + 0.5 * tf.eye(tf.shape(x)[0], dtype=F64)
            a = tf.linalg.solve(K, y)
            loss = tf.reduce_sum(a * y)
        g = tape.gradient(loss, x)
        Kxz = rbf(x, x[:50], 1.0, 1.0)
        w = tf.linalg.lstsq(Kxz, y, l2_regularizer=1e-3)
        return loss, g, w
    return fn, (x, y)


# 19. QR of a kernel matrix
def p_qr_kernel(n):
    x, y = data(n, seed=19)

    def fn(x, y):
        K = rbf(x, x, 1.0, 1.0) + 0.5 * tf.eye(tf.shape(x)[0], dtype=F64)
        q, r = tf.linalg.qr(K)
        sol = tf.linalg.triangular_solve(r, tf.transpose(q) @ y, lower=False)
        return sol, tf.reduce_sum(tf.math.log(tf.abs(tf.linalg.diag_part(r))))
    return fn, (x, y)


# 20. Hutchinson estimator of trace(K^-1 dK) with cholesky_solve on probes, and the quad term
def p_hutchinson(n):
    x, y = data(n, seed=20)
    rng = np.random.default_rng(200)
    z = tf.constant(rng.choice([-1.0, 1.0], size=(n, 16)), F64)
    ls = tf.constant(1.0, F64)

    def fn(x, y, z, ls):
        with tf.GradientTape() as tape:
            tape.watch(ls)
            K = rbf(x, x, ls, 1.0)
        Kn = K + 0.2 * tf.eye(tf.shape(x)[0], dtype=F64)
        L = tf.linalg.cholesky(Kn)
        dK_z = tape.gradient(K, ls, output_gradients=None)  # scalar d(sum K)/dls
        with tf.GradientTape() as t2:
            t2.watch(ls)
            Kz = rbf(x, x, ls, 1.0) @ z
        # Jacobian-vector trick: d(K z)/dls via forward-mode emulated by a second tape
        with tf.autodiff.ForwardAccumulator(ls, tf.constant(1.0, F64)) as acc:
            K2 = rbf(x, x, ls, 1.0)
            dKz_in = K2 @ z
        dKz = acc.jvp(dKz_in)
        Kinv_z = tf.linalg.cholesky_solve(L, z)
        tr = tf.reduce_mean(tf.reduce_sum(Kinv_z * dKz, 0))
        alpha = tf.linalg.cholesky_solve(L, y)
        return tr, tf.reduce_sum(alpha * y), dK_z
    return fn, (x, y, z, ls)


# 21. kernel matrix used twice (K@a, K@b), K + K^T, K ⊙ K, with grads wrt x (tape inside)
def p_k_reused(n):
    x, y = data(n, seed=21)
    rng = np.random.default_rng(210)
    a = tf.constant(rng.normal(size=(n, 4)), F64)

    def fn(x, y, a):
        with tf.GradientTape() as tape:
            tape.watch(x)
            K = rbf(x, x, 0.7, 1.0)
            S = K + tf.transpose(K)
            H = K * K
            loss = tf.reduce_sum((K @ a) ** 2) + tf.reduce_sum(y * (S @ y)) + tf.reduce_sum(H @ a)
        return loss, tape.gradient(loss, x)
    return fn, (x, y, a)


# 22. power iteration with gradient through loop (largest eigenvalue of K wrt ls)
def p_power_iter_grad(n):
    x, _ = data(n, seed=22)
    ls = tf.constant(0.8, F64)

    def fn(x, ls):
        with tf.GradientTape() as tape:
            tape.watch(ls)
            K = rbf(x, x, ls, 1.0)
            v = tf.ones([tf.shape(x)[0], 1], F64)
            i = tf.constant(0)
            def body(i, v):
                w = K @ v
                return i + 1, w / tf.norm(w)
            _, v = tf.while_loop(lambda i, v: i < 8, body, (i, v), maximum_iterations=8)
            lam = tf.reduce_sum(v * (K @ v))
        return lam, tape.gradient(lam, ls)
    return fn, (x, ls)


# 23. Jacobi iteration solve (K + cI) a = y in while_loop, f32
def p_jacobi_f32(n):
    x, y = data(n, seed=23, dtype=tf.float32)

    def fn(x, y):
        K = rbf(x, x, 0.5, 1.0) + 3.0 * tf.eye(tf.shape(x)[0])
        d = tf.linalg.diag_part(K)[:, None]
        R = K - tf.linalg.diag(tf.linalg.diag_part(K))
        a = y / d
        for _ in tf.range(20):
            a = (y - R @ a) / d
        return a
    return fn, (x, y)


PROGRAMS = {
    # name: (build, small, big, budget_mib, rtol)
    "gp_nll_chol_solve": (p_gp_nll_chol_solve, 300, 3000, 256, 1e-6),
    "gp_f32_trisolve_adjoint": (p_gp_f32_trisolve_adjoint, 400, 4000, 256, 1e-4),
    "batched_chol_logdet": (p_batched_chol_logdet, 200, 1500, 256, 1e-6),
    "tfp_mvn_tril": (p_tfp_mvn_tril, 400, 3000, 256, 1e-6),
    "linop_chol": (p_linop_chol, 400, 3000, 256, 1e-6),
    "linop_lowertri_f32": (p_linop_lowertri_f32, 400, 4000, 256, 1e-4),
    "pcg_grad": (p_pcg_grad, 500, 4000, 192, 1e-6),
    "laplace_newton": (p_laplace_newton, 300, 3000, 192, 1e-6),
    "inverse_trace_grad": (p_inverse_trace_grad, 400, 3000, 192, 1e-6),
    "eigh_grad": (p_eigh_grad, 200, 1500, 128, 1e-6),
    "matrix_solve_lstsq": (p_matrix_solve_lstsq, 400, 3000, 192, 1e-6),
    "qr_kernel": (p_qr_kernel, 300, 2500, 192, 1e-6),
    "hutchinson": (p_hutchinson, 400, 3000, 192, 1e-6),
    "k_reused": (p_k_reused, 500, 4000, 192, 1e-9),
    "power_iter_grad": (p_power_iter_grad, 500, 4000, 192, 1e-8),
    "jacobi_f32": (p_jacobi_f32, 500, 6000, 96, 1e-4),
}


# 24. diag-flavoured idioms a researcher writes: tridiagonal precision (off-diagonal diag),
# diag with padding, rectangular eye jitter, diag_part with offset, eye times a vector
def p_odd_diags(n):
    x, y = data(n, seed=24)
    rng = np.random.default_rng(240)
    d = tf.constant(rng.uniform(1, 2, size=n), F64)
    e = tf.constant(rng.uniform(0.1, 0.3, size=n - 1), F64)

    def fn(x, y, d, e):
        with tf.GradientTape() as tape:
            tape.watch([x, d, e])
            K = rbf(x, x, 1.0, 1.0)
            # tridiagonal precision Q = diag(d) + offdiag(e) + offdiag(e)^T
            Q = tf.linalg.diag(d) + tf.linalg.diag(e, k=1) + tf.linalg.diag(e, k=-1)
            A = K + tf.linalg.inv(Q)
            KQ = tf.linalg.diag(d, k=1) @ tf.pad(K, [[0, 1], [0, 1]])          # [n+1, n+1]
            P = tf.linalg.diag(d, padding_value=0.5) @ K                       # dense, not diagonal
            R = K + 0.7 * tf.eye(n, dtype=F64) * d[None, :]                    # jitter by a vector
            Kr = K[:, :n - 10] + 1e-3 * tf.eye(n, n - 10, dtype=F64)           # rectangular eye
            L = tf.linalg.cholesky(A + 1e-6 * tf.eye(n, dtype=F64))
            loss = (tf.reduce_sum(tf.math.log(tf.linalg.diag_part(L)))
                    + tf.reduce_sum(tf.linalg.diag_part(KQ, k=1))
                    + tf.reduce_sum(tf.linalg.diag_part(P))
                    + tf.reduce_sum(tf.linalg.diag_part(K @ K, k=2))
                    + tf.linalg.trace(R) + tf.reduce_sum(tf.linalg.diag_part(Kr))
                    + tf.reduce_sum(tf.linalg.diag_part(Kr @ tf.transpose(Kr), k=-1))
                    + tf.reduce_sum(y * tf.linalg.cholesky_solve(L, y)))
        return loss, tape.gradient(loss, [x, d, e])
    return fn, (x, y, d, e)


# 25. Cholesky gradient with an arbitrary (non-symmetric) upstream: reparameterised samples L @ eps
def p_chol_sample_grad(n):
    x, _ = data(n, seed=25)
    rng = np.random.default_rng(250)
    eps = tf.constant(rng.normal(size=(n, 3)), F64)
    w = tf.constant(rng.normal(size=(n, 3)), F64)
    ls = tf.constant(0.9, F64)

    def fn(x, eps, w, ls):
        with tf.GradientTape() as tape:
            tape.watch([ls, x])
            K = rbf(x, x, ls, 1.0) + 1e-2 * tf.eye(tf.shape(x)[0], dtype=F64)
            L = tf.linalg.cholesky(K)
            f = L @ eps
            loss = tf.reduce_sum(w * f) + tf.reduce_sum(L[:, 0]) + tf.reduce_sum(tf.sin(L))
        return loss, tape.gradient(loss, [ls, x])
    return fn, (x, eps, w, ls)

PROGRAMS["odd_diags"] = (p_odd_diags, 200, 2000, 128, 1e-6)
PROGRAMS["chol_sample_grad"] = (p_chol_sample_grad, 300, 3000, 192, 1e-6)


# 26. upper-triangular factor (R = Lᵀ), solves with lower=False and adjoint=True, wide RHS, grads
def p_upper_solves(n):
    x, y = data(n, seed=26)
    ls = tf.constant(1.1, F64)

    def fn(x, y, ls):
        with tf.GradientTape() as tape:
            tape.watch([ls, x])
            K = rbf(x, x, ls, 1.0) + 0.2 * tf.eye(tf.shape(x)[0], dtype=F64)
            R = tf.transpose(tf.linalg.cholesky(K))                       # upper
            Kc = rbf(x, x[: n // 2] + 0.1, ls, 1.0)                      # [n, n/2] wide rhs
            A = tf.linalg.triangular_solve(R, Kc, lower=False, adjoint=True)   # R^-T Kc = L^-1 Kc
            B = tf.linalg.triangular_solve(R, A, lower=False)                  # R^-1 A
            loss = tf.reduce_sum(A ** 2) + tf.reduce_sum(B * Kc) + tf.reduce_sum(
                tf.linalg.triangular_solve(R, y, lower=False, adjoint=True) ** 2)
        return loss, tape.gradient(loss, [ls, x])
    return fn, (x, y, ls)

PROGRAMS["upper_solves"] = (p_upper_solves, 300, 3000, 192, 1e-6)
