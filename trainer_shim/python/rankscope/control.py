"""Operator control of a running job from Python: the same Query.SetControl RPC as
``rankscope ctl enable|disable|set``.

    from rankscope.control import set_control
    set_control("127.0.0.1:50051", "exp-42", enabled=True, every=10)

The collector answers with the control it pushes to every connected rank of the job; each rank
applies it at the same step (see ``rankscope.torch`` and docs/shim.md).
"""

from rankscope import _native, tls


def set_control(
    collector: str,
    job: str,
    *,
    enabled: bool | None = None,
    every: int | None = None,
    sketch_dim: int | None = None,
    lead_steps: int = 5,
    timeout: float = 10.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_target_name: str | None = None,
    auth_token: str | None = None,
) -> dict:
    """Sends Query.SetControl. Returns {generation, apply_at_step, enabled, every, sketch_dim,
    ranks_notified}. Raises RuntimeError with the gRPC status when the collector refuses (e.g.
    NOT_FOUND: the job is not known to it) or cannot be reached within ``timeout`` seconds.
    TLS: ``tls_*`` or ``$RANKSCOPE_TLS_*`` (see rankscope.tls), as for the agent;
    ``auth_token``: the collector's shared token, if it requires one."""
    if every is not None and every < 1:
        raise ValueError("every must be >= 1")
    if sketch_dim is not None and sketch_dim < 1:
        raise ValueError("sketch_dim must be >= 1")
    return _native.set_control(
        collector,
        job,
        enabled=enabled,
        every=every,
        sketch_dim=sketch_dim,
        lead_steps=max(1, int(lead_steps)),
        timeout_seconds=float(timeout),
        auth_token=auth_token or "",
        **tls.resolve(tls_ca, tls_cert, tls_key, tls_target_name),
    )
