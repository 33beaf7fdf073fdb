"""Work on a run that is no step of it: the checks before it starts, the reports after.

``preflight`` checks a config before Prefect starts and a run folder is made (the model
files, the environment, that the prompts fit); ``prompt_preview`` renders a task's opening
prompt for ``rollflow env show``; ``run_summary`` writes the lines a finished training run
ends with; ``rescore`` and ``replay`` score or replay a stored run's episodes with an
edited environment (``rollflow rescore`` / ``replay``); ``gate_simulation`` measures the
gate's error rates on simulated nights. The flows (``rollflow.flows``) use this package; it
uses the stages' shared helpers (``rollflow.tasks``: shaping, schedule, the gate's rule)
and the rooms below them, never a stage's module, a flow or the cluster.
"""
