"""An ordinary ``openai``-SDK agent for the bundled tool-use game, trained as it is.

``agent.run`` is the agent (it imports only ``openai``, ``json`` and ``game``);
``game.tasks`` and ``game.reward`` are the task list and the reward, reused from
``rollflow.envs.tool_use_game``; ``expert.expert`` answers the agent's calls as the game's
own expert does, for ``rollflow sft``'s transcripts. ``configs/openai_agent.toml`` trains it
through ``rollflow.envs.openai_agent:load_environment``.
"""
