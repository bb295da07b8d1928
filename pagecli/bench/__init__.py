"""The logic of `pagecli bench`: scenarios run in-process (scenarios.py) or against servers
(serving.py), transformers baselines (baselines.py), and the report (report.py)."""
