"""Pure Altair chart builders of the pages, one module per page (outliers, results, kernels) and what they share
(base). A DataFrame (or calibration statistics, for the ``*_frame`` helpers) in, an ``alt.Chart`` out: no
Streamlit calls, no torch. Every builder bounds what it embeds (base.MAX_MARKS data rows at most)."""
