"""The application layer: the use cases the Streamlit pages and the ``quantplan`` command both call, one module per
noun (models, datasets, calibration, jobs, queue, workers, plans, plan_editor, serving, kernels, scoring, sweeps,
autoplan, exchange), with deployment (settings), units (sizes for people) and errors (:class:`Refused`).

Each use case validates, decides, saves and queues through ``store`` and ``jobs``; none imports torch,
transformers, streamlit or the worker (quantcore only where a module is torch-free at import). Callers import the
modules they use; this package re-exports nothing.
"""
