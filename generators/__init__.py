"""The generator: what samples the policy's versions for a run, and the versions themselves.

``generator`` says what a generator is (one face for every backend and both schedules) and
holds what the backends share; ``vllm_generator`` is the vLLM one (managed or external
servers, replicas, publication, restarts), ``managed_server`` what it asks of a server
and how it reads one's health; ``async_generator`` keeps it sampling while the
trainer trains; ``run_generator`` picks the class for a run (``open_generator``);
``lending`` lends one to the flows a caller runs in a row; ``policy_io`` binds a version's
policy for a stage; ``cpu_split`` parts the cores between server and trainer. A version on
disk is ``checkpoints``; which model a run loads, in which dtype, on which device, is
``models``. The stages (``rollflow.tasks``) and the cluster use this package; it uses the
configuration, ``policy``, ``storage`` and ``envs``, never a stage.
"""
