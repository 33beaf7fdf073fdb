"""The configuration: one TOML file's sections as typed, frozen, validated objects.

``run`` holds ``RunConfig`` and its small sections, and reads and writes the file
(``load_config``, ``parse_config``, ``config_to_toml``); the large sections have a module
each: ``rollout``, ``train``, ``pipeline`` (with the gate's rule) and ``cluster``.
``parsing`` is the machinery under the sections (keys, aliases, retired settings, type
checks, ``ConfigError``); ``toml_writer`` writes TOML, which the standard library only
reads; ``checks`` holds the rules across sections a training run needs; ``grpo`` is the
reference API's flat ``GRPOConfig``, mapped onto ``RunConfig``. The example TOML files live
in ``configs/`` at the top of the repository, not here.

Every other room reads the configuration; it imports ``policy`` (the loss names) and
nothing above it: no stage, no generator, no flow.
"""
