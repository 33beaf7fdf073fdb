"""rollflow stages: rollout, scoring, flatten, teacher, train, metrics, the async collector's
admission, and the pipeline's sft and gate (one module each), with the helpers they share
(``schedule``, ``shaping``, ``step_health``, ``prompts``, ``gate_rule``, ...) and their tracking.

What works on a run beside its steps (preflight, rescore, replay, the run's summary) is
``rollflow.ops``.
"""
