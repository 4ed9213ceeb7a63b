"""Mutual TLS and the shared token on the collector's gRPC port, end to end: a real collector
process with certificates made by ``openssl`` at test time (tls_certs.py), real agents (the C++
agent through rankscope._native), the real CLI.

Refusals are observed, not timed: a refused agent's stats show the failure (last_error) while it
keeps accepting records, and the database holds nothing of its job.
"""

import os
import subprocess

import pytest

from conftest import CLI_BIN, COLLECTOR_BIN, Collector, wait_until
from fault_proxy import FaultProxy
import tls_certs

_native = pytest.importorskip("rankscope._native")
from rankscope import tls as rs_tls  # noqa: E402

DIM = 16
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return tls_certs.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_collector(tmp_path_factory, pki):
    """Mutual TLS and the shared token, composed."""
    d = tmp_path_factory.mktemp("mtls")
    (d / "token").write_text(TOKEN + "\n")
    c = Collector(
        d,
        extra_args=[
            f"--tls_cert_file={pki / 'server.pem'}",
            f"--tls_key_file={pki / 'server.key'}",
            f"--tls_client_ca_file={pki / 'ca.pem'}",
            f"--auth_token_file={d / 'token'}",
        ],
    ).start()
    yield c
    if c.proc is not None:
        c.stop()


def make_agent(collector, job, **kwargs):
    kwargs.setdefault("auth_token", TOKEN)
    return _native.Agent(
        collector=collector.address,
        job=job,
        rank=0,
        world_size=1,
        sketch_dim=DIM,
        initial_backoff_s=0.05,
        max_backoff_s=0.5,
        **kwargs,
    )


def record_steps(agent, n):
    sketch = _native.Sketch(DIM)
    for step in range(1, n + 1):
        assert agent.record_sketch(step, 1.0 + step, 2.0, sketch) == ""


def assert_refused(collector, agent, job, expect_in_error):
    """The agent keeps accepting records (training goes on), records why it is refused, and the
    collector stores nothing of its job."""
    record_steps(agent, 20)
    err = wait_until(lambda: agent.stats()["last_error"], 30, f"{job}'s agent to be refused")
    assert expect_in_error in err, err
    s = agent.stats()
    assert s["recorded"] == 20 and s["acked"] == 0 and not s["connected"], s
    agent.close(0)
    assert collector.query("SELECT COUNT(*) FROM rank_steps WHERE job = ?", (job,)) in ([], [(0,)])
    assert collector.query("SELECT COUNT(*) FROM jobs WHERE job = ?", (job,)) in ([], [(0,)])


def test_mtls_agent_reports_are_stored(mtls_collector, pki):
    agent = make_agent(
        mtls_collector,
        "mtls-ok",
        tls_ca_file=str(pki / "ca.pem"),
        tls_cert_file=str(pki / "client.pem"),
        tls_key_file=str(pki / "client.key"),
    )
    record_steps(agent, 10)
    assert agent.flush(60) == ""
    assert agent.stats()["acked"] == 10
    agent.close(1)
    wait_until(
        lambda: (
            mtls_collector.query("SELECT COUNT(*) FROM rank_steps WHERE job = 'mtls-ok'") == [(10,)]
        ),
        30,
        "10 rows stored",
    )


def test_tls_settings_from_environment(mtls_collector, pki, monkeypatch):
    """The shim's RANKSCOPE_TLS_* variables (rankscope.tls.resolve, used by attach)."""
    monkeypatch.setenv("RANKSCOPE_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("RANKSCOPE_TLS_CERT", str(pki / "client.pem"))
    monkeypatch.setenv("RANKSCOPE_TLS_KEY", str(pki / "client.key"))
    monkeypatch.setenv("RANKSCOPE_TLS_TARGET_NAME", "rankscope-collector")
    options = rs_tls.resolve()
    assert options["tls_target_name"] == "rankscope-collector"
    agent = make_agent(mtls_collector, "mtls-env", **options)
    record_steps(agent, 3)
    assert agent.flush(60) == ""
    agent.close(1)


def test_agent_without_client_certificate_is_refused(mtls_collector, pki):
    agent = make_agent(mtls_collector, "mtls-nocert", tls_ca_file=str(pki / "ca.pem"))
    assert_refused(mtls_collector, agent, "mtls-nocert", "UNAVAILABLE")


def test_agent_with_untrusted_client_certificate_is_refused(mtls_collector, pki):
    agent = make_agent(
        mtls_collector,
        "mtls-rogue",
        tls_ca_file=str(pki / "ca.pem"),
        tls_cert_file=str(pki / "rogue-client.pem"),
        tls_key_file=str(pki / "rogue-client.key"),
    )
    assert_refused(mtls_collector, agent, "mtls-rogue", "UNAVAILABLE")


def test_plaintext_agent_is_refused(mtls_collector):
    agent = make_agent(mtls_collector, "mtls-plain")
    assert_refused(mtls_collector, agent, "mtls-plain", "UNAVAILABLE")


def test_token_still_checked_over_mtls(mtls_collector, pki):
    agent = make_agent(
        mtls_collector,
        "mtls-badtoken",
        auth_token="wrong",
        tls_ca_file=str(pki / "ca.pem"),
        tls_cert_file=str(pki / "client.pem"),
        tls_key_file=str(pki / "client.key"),
    )
    assert_refused(mtls_collector, agent, "mtls-badtoken", "UNAUTHENTICATED")


def test_bad_agent_tls_files_fail_at_creation(mtls_collector, pki, tmp_path):
    with pytest.raises(ValueError, match="cannot read tls_ca_file"):
        make_agent(mtls_collector, "x", tls_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="not the private key"):
        make_agent(
            mtls_collector,
            "x",
            tls_ca_file=str(pki / "ca.pem"),
            tls_cert_file=str(pki / "client.pem"),
            tls_key_file=str(pki / "server.key"),
        )
    with pytest.raises(ValueError, match="give both or neither"):
        make_agent(
            mtls_collector,
            "x",
            tls_ca_file=str(pki / "ca.pem"),
            tls_cert_file=str(pki / "client.pem"),
        )


def cli(collector, *args):
    return subprocess.run(
        [str(CLI_BIN), f"--collector={collector.address}", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_over_mtls_with_token(mtls_collector, pki, tmp_path):
    """The Query service shares the port: the same client certificate, and the same token."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    mtls = [
        f"--tls_ca_file={pki / 'ca.pem'}",
        f"--tls_cert_file={pki / 'client.pem'}",
        f"--tls_key_file={pki / 'client.key'}",
    ]
    ok = cli(mtls_collector, *mtls, f"--auth_token_file={tmp_path / 'token'}", "jobs")
    assert ok.returncode == 0, ok.stderr
    assert "mtls-ok" in ok.stdout
    no_token = cli(mtls_collector, *mtls, "jobs")
    assert no_token.returncode != 0
    assert "auth token" in no_token.stderr, no_token.stderr
    no_cert = cli(
        mtls_collector,
        f"--tls_ca_file={pki / 'ca.pem'}",
        f"--auth_token_file={tmp_path / 'token'}",
        "jobs",
    )
    assert no_cert.returncode != 0
    assert "mutual TLS" in no_cert.stderr, no_cert.stderr
    plaintext = cli(mtls_collector, f"--auth_token_file={tmp_path / 'token'}", "jobs")
    assert plaintext.returncode != 0
    assert "--tls_ca_file" in plaintext.stderr, plaintext.stderr


def test_python_set_control_over_mtls_with_token(mtls_collector, pki):
    from rankscope.control import set_control

    tls_files = dict(
        tls_ca=str(pki / "ca.pem"),
        tls_cert=str(pki / "client.pem"),
        tls_key=str(pki / "client.key"),
    )
    agent = make_agent(
        mtls_collector,
        "mtls-ctl",
        tls_ca_file=tls_files["tls_ca"],
        tls_cert_file=tls_files["tls_cert"],
        tls_key_file=tls_files["tls_key"],
    )
    record_steps(agent, 1)
    assert agent.flush(60) == ""
    r = set_control(mtls_collector.address, "mtls-ctl", every=2, auth_token=TOKEN, **tls_files)
    assert r["every"] == 2
    with pytest.raises(RuntimeError, match="auth token"):
        set_control(mtls_collector.address, "mtls-ctl", every=3, **tls_files)
    agent.close(1)


def test_server_side_tls_and_target_name(tmp_path, pki):
    """cert + key without a client CA: TLS authenticates the collector only."""
    c = Collector(
        tmp_path,
        extra_args=[
            f"--tls_cert_file={pki / 'server.pem'}",
            f"--tls_key_file={pki / 'server.key'}",
        ],
    ).start()
    try:
        ok = make_agent(
            c,
            "tls-ok",
            auth_token="",
            tls_ca_file=str(pki / "ca.pem"),
            tls_target_name="rankscope-collector",
        )
        record_steps(ok, 5)
        assert ok.flush(60) == ""
        ok.close(1)
        # The collector's certificate does not name "elsewhere": the agent refuses the collector.
        wrong_name = make_agent(
            c,
            "tls-wrong-name",
            auth_token="",
            tls_ca_file=str(pki / "ca.pem"),
            tls_target_name="elsewhere",
        )
        assert_refused(c, wrong_name, "tls-wrong-name", "UNAVAILABLE")
        # A CA that did not sign the collector's certificate: refused as well.
        rogue_ca = make_agent(
            c, "tls-rogue-ca", auth_token="", tls_ca_file=str(pki / "rogue-ca.pem")
        )
        assert_refused(c, rogue_ca, "tls-rogue-ca", "UNAVAILABLE")
        plain = make_agent(c, "tls-plain", auth_token="")
        assert_refused(c, plain, "tls-plain", "UNAVAILABLE")
    finally:
        c.stop()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--tls_cert_file={d}/server.pem", "--tls_key_file={d}/missing.key"],
            "cannot read --tls_key_file",
        ),
        (
            ["--tls_cert_file={d}/server.pem", "--tls_key_file={d}/client.key"],
            "is not the private key of the certificate",
        ),
        (["--tls_cert_file={d}/server.pem"], "TLS needs both"),
        (["--tls_client_ca_file={d}/ca.pem"], "TLS needs both"),
        (
            [
                "--tls_cert_file={d}/server.pem",
                "--tls_key_file={d}/server.key",
                "--tls_client_ca_file={d}/server.key",
            ],
            "holds no PEM certificate",
        ),
    ],
)
def test_collector_refuses_to_start_with_bad_tls_files(tmp_path, pki, flags, message):
    if not COLLECTOR_BIN.exists():
        pytest.skip(f"{COLLECTOR_BIN} not built")
    out = subprocess.run(
        [
            str(COLLECTOR_BIN),
            "--grpc_address=127.0.0.1:0",
            "--metrics_address=",
            "--http_address=",
            f"--db_path={tmp_path / 'x.db'}",
            *[f.format(d=pki) for f in flags],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert not (tmp_path / "x.db").exists()  # checked before anything is created


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def test_rotated_certificates_are_picked_up_without_restarts(tmp_path, pki):
    """Everything moves to a new CA while an mTLS agent streams: the collector's certificate and
    key, the client CA it trusts, the agent's trust bundle and client certificate, each file
    replaced atomically on disk (rename, as cert-manager does). Neither process restarts. The open
    stream goes on over its connection; a new client trusting only the new CA gets in once the
    collector re-read its files; and when the agent's connection is reset (through the fault
    proxy), it reconnects with the new files, which the collector accepts only from the new CA.
    Every report stored exactly once."""
    live = tmp_path / "live"
    live.mkdir()

    def install(src, name):
        (live / f"{name}.new").write_bytes((pki / src).read_bytes())
        os.replace(live / f"{name}.new", live / name)

    for src, name in [
        ("server.pem", "server.pem"),
        ("server.key", "server.key"),
        ("ca.pem", "client-ca.pem"),
        ("ca.pem", "agent-ca.pem"),
        ("client.pem", "agent.pem"),
        ("client.key", "agent.key"),
    ]:
        install(src, name)
    c = Collector(
        tmp_path,
        extra_args=[
            f"--tls_cert_file={live / 'server.pem'}",
            f"--tls_key_file={live / 'server.key'}",
            f"--tls_client_ca_file={live / 'client-ca.pem'}",
            "--tls_reload_interval=1s",
        ],
    ).start()
    proxy = FaultProxy("127.0.0.1", "127.0.0.1", c.port).start()
    job = "rotate"
    agent = _native.Agent(
        collector=proxy.address,
        job=job,
        rank=0,
        world_size=1,
        sketch_dim=DIM,
        initial_backoff_s=0.05,
        max_backoff_s=0.5,
        tls_ca_file=str(live / "agent-ca.pem"),
        tls_cert_file=str(live / "agent.pem"),
        tls_key_file=str(live / "agent.key"),
        tls_reload_interval_s=1,
    )
    sketch = _native.Sketch(DIM)
    try:

        def record(first, last):
            for step in range(first, last + 1):
                assert agent.record_sketch(step, 1.0 + step, 2.0, sketch) == ""

        record(1, 10)
        assert agent.flush(60) == ""
        assert proxy.accepted == 1

        for src, name in [
            ("server2.pem", "server.pem.tmp"),
            ("server2.key", "server.key"),
            ("ca2.pem", "client-ca.pem"),
            ("ca2.pem", "agent-ca.pem"),
            ("client2.pem", "agent.pem.tmp"),
            ("client2.key", "agent.key"),
        ]:
            install(src, name)
        # Each certificate right after its key: a watcher's read between the two may see a
        # mismatched pair for one interval, which only delays new handshakes.
        os.replace(live / "server.pem.tmp", live / "server.pem")
        os.replace(live / "agent.pem.tmp", live / "agent.pem")

        # The open stream is not dropped by the rotation: same connection, no reconnect.
        record(11, 20)
        assert agent.flush(60) == ""
        s = agent.stats()
        assert s["acked"] == 20 and s["reconnects"] == 0, s
        assert proxy.accepted == 1

        # The collector serves the new certificate and trusts only the new CA, without a restart:
        # a client of the new PKI only gets in.
        def client_of(job, ca, cert):  # a one-rank agent of the PKI named by its files
            return make_agent(
                c,
                job,
                auth_token="",
                tls_ca_file=str(pki / f"{ca}.pem"),
                tls_cert_file=str(pki / f"{cert}.pem"),
                tls_key_file=str(pki / f"{cert}.key"),
            )

        probe = client_of("rotate-probe", "ca2", "client2")
        probe.record_sketch(1, 1.0, 2.0, sketch)
        assert probe.flush(60) == ""
        probe.close(1)
        assert_refused(c, client_of("rotate-old", "ca", "client"), "rotate-old", "UNAVAILABLE")

        # The agent's connection reset: it reconnects with its re-read trust bundle and
        # certificate (the old ones would fail both ways) and resends nothing twice.
        assert proxy.reset_all() == 1
        record(21, 30)
        assert agent.flush(60) == "", agent.stats()
        s = agent.stats()
        assert s["acked"] == 30 and s["reconnects"] >= 1 and s["dropped"] == 0, s
        assert proxy.accepted >= 2
        agent.close(1)
        per_step = c.query(
            "SELECT COUNT(*), COUNT(DISTINCT step) FROM rank_steps WHERE job = ?", (job,)
        )
        assert per_step == [(30, 30)]
    finally:
        proxy.close()
        c.stop()
