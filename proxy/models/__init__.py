"""Which child answers a request: ``router.ModelRouter`` resolves a request's model (name, alias,
default, the wait for an on-demand load, the 503 of a model restarting on SIGHUP) to one ``lane.Lane``,
one served model's admission gate and source. There is always at least one lane: one model is a set of
one."""
