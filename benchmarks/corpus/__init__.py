"""The acceptance corpus for `memory_budget` as the one knob.

Programs people actually write (GPflow losses and predictions, kernel matrices,
attention, kNN, reductions broadcast back over what they reduced, loops), each at a
`small` size where stock XLA fits its budget and a `big` size where it does not.

    programs.py  the programs, their sizes, budgets and tolerances
    trial.py     what runs in one isolated process: stock, tfmem, and the equality check
    run.py       the full corpus → RESULTS.md (budget fidelity table) and results.json

Example:
    >>> from benchmarks.corpus.programs import PROGRAMS
    >>> fn, args = PROGRAMS["kxx_expanded_matmul"].build(PROGRAMS["kxx_expanded_matmul"].small)
"""
