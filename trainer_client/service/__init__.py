"""The planner service's client: its config, the RPC client, where a plan comes from (the service or
the in-process fallback), planning ahead, agreeing on one plan across ranks, calibration, the client's
metrics, and `BatchPlannerClient`, which puts them together with `trainer_client.plans`."""
