"""rollflow on a Ray cluster: the cluster, the rollout fan-out, generator replicas, the remote trainer.

``ray_cluster`` starts or joins the cluster, ``ray_nodes`` names its nodes and places
work on them; ``ray_rollout`` plays a step's rollout chunks on its nodes; ``ray_replicas`` hosts managed vLLM replicas as actors on placed nodes;
``ray_trainer`` runs the train stage on a placed node; ``run_cluster`` opens what a run's
``[cluster]`` asks for. The flows (``rollflow.flows``) use this package; it uses the stages
(``rollflow.tasks``) and never the flows. Ray is imported only where a cluster is used.
"""
