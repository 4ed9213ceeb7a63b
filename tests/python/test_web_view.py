"""The collector's web view in a real browser (issue 14): a real collector, real agents
(rankscope-loadgen), real SQLite and Debian's headless Chromium (tests/python/browser.py).

Assertions read the page's DOM and its state object (window.rankscope), never pixels. Every
wait polls a condition against a generous deadline. Screenshots go to
$RANKSCOPE_BUILD_DIR/test-artifacts/web/, with the 1,024-rank render times (a measurement, see
docs/PERFORMANCE.md "Web view", not an assertion) in render_1024.json.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BUILD_DIR, Collector, wait_until

LOADGEN_BIN = BUILD_DIR / "bin" / "rankscope-loadgen"
ARTIFACTS = BUILD_DIR / "test-artifacts" / "web"


@pytest.fixture
def browser():
    from browser import CHROMIUM, Browser

    if not Path(CHROMIUM).exists():
        if os.environ.get("RANKSCOPE_E2E_REQUIRED"):
            pytest.fail(f"{CHROMIUM} missing (./run setup installs chromium)")
        pytest.skip(f"{CHROMIUM} missing")
    b = Browser()
    yield b
    b.close()


@pytest.fixture
def web_collector(tmp_path):
    c = Collector(tmp_path, step_timeout="1s").start()
    yield c
    if c.proc is not None:
        c.stop()


def loadgen(collector, job, *flags, background=False):
    if not LOADGEN_BIN.exists():
        pytest.skip(f"{LOADGEN_BIN} not built")
    cmd = [str(LOADGEN_BIN), f"--collector={collector.address}", f"--job={job}", *flags]
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=120):
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out


def url(collector, path):
    return f"http://127.0.0.1:{collector.http_port}{path}"


def test_jobs_list_faulty_heatmap_and_groups(web_collector, browser):
    c = web_collector
    common = ("--ranks=16", "--steps=80", "--cosine=0.9")
    finish(
        [
            loadgen(c, "web-healthy", *common),
            # Rank 5 goes astray from step 20 (loss +1, grad norm x3, random direction); rank 11
            # falls silent at step 50: every later step times out without it.
            loadgen(
                c,
                "web-faulty",
                *common,
                "--outlier_rank=5",
                "--outlier_from_step=20",
                "--silent_rank=11",
                "--silent_from_step=50",
            ),
            # Four data-parallel groups of 4; global rank 9 (group g2) is an outlier.
            loadgen(
                c, "web-groups", *common, "--groups=4", "--outlier_rank=9", "--outlier_from_step=10"
            ),
        ]
    )
    # The last steps of web-faulty close by timeout (rank 11 is silent), then reach SQLite.
    wait_until(
        lambda: (
            c.query("SELECT COUNT(*) FROM step_stats WHERE job = 'web-faulty' AND step = 80")[0][0]
            == 1
        ),
        30,
        "web-faulty's last step stored",
    )

    # ---- the jobs list ----
    browser.goto(url(c, "/"))
    keys = {
        "web-healthy",
        "web-faulty",
        "web-groups",
        "web-groups/g0",
        "web-groups/g1",
        "web-groups/g2",
        "web-groups/g3",
    }
    rows_js = (
        "JSON.stringify([...document.querySelectorAll('#jobs-body tr[data-key]')]"
        ".map(r => [r.dataset.key, r.className, r.dataset.alerts]))"
    )
    browser.wait_for(
        f"{rows_js}.length > 2 && {json.dumps(sorted(keys))}.every(k => "
        f"{rows_js}.includes(JSON.stringify(k)))",
        30,
        "every job in the list",
    )
    rows = {k: (cls, alerts) for k, cls, alerts in json.loads(browser.eval(rows_js))}
    assert set(rows) == keys
    assert rows["web-healthy"] == ("job", "")
    assert set(rows["web-faulty"][1].split(",")) == {"outlier", "missing"}
    # The groups are listed under their job, the job's row first.
    order = [k for k, _, _ in json.loads(browser.eval(rows_js))]
    i = order.index("web-groups")
    assert order[i + 1 : i + 5] == [
        "web-groups/g0",
        "web-groups/g1",
        "web-groups/g2",
        "web-groups/g3",
    ]
    assert all(rows[f"web-groups/g{g}"][0] == "group" for g in range(4))
    assert rows["web-groups/g2"][1] == "outlier" and rows["web-groups/g0"][1] == ""
    browser.screenshot(ARTIFACTS / "jobs.png")

    # ---- the faulty job: rank 5 an outlier, rank 11 missing, the others not flagged ----
    browser.goto(url(c, "/job/web-faulty"))
    flagged = json.loads(
        browser.wait_for(
            "window.rankscope.flagged && window.rankscope.matrix.steps.length >= 80 && "
            "JSON.stringify(window.rankscope.flagged)",
            30,
            "the heatmap of web-faulty",
        )
    )
    assert flagged["outlier"] == [5] and flagged["missing"] == [11], flagged
    assert flagged["divergent"] == [] and flagged["nonfinite"] == [], flagged
    items = json.loads(
        browser.eval(
            "JSON.stringify([...document.querySelectorAll('#flagged li[data-rank]')]"
            ".map(li => [Number(li.dataset.rank), li.dataset.kinds]))"
        )
    )
    assert items == [[5, "outlier"], [11, "missing"]]
    matrix = browser.eval(
        "JSON.stringify({w: window.rankscope.matrix.world_size, "
        "n: window.rankscope.matrix.steps.map(s => s.cosine.length), "
        "h: document.getElementById('heatmap').height})"
    )
    matrix = json.loads(matrix)
    assert matrix["w"] == 16 and set(matrix["n"]) == {16}
    browser.screenshot(ARTIFACTS / "job_faulty.png")

    # Clicking a flagged rank opens its own series.
    browser.eval("document.querySelector('#flagged li[data-rank=\"5\"]').click()")
    series = json.loads(
        browser.wait_for(
            "window.rankscope.rankSeries && window.rankscope.rankSeries.rank === 5 && "
            "document.getElementById('rank-title') && "
            "JSON.stringify(window.rankscope.rankSeries.steps)",
            30,
            "rank 5's series",
        )
    )
    assert [s["step"] for s in series] == list(range(1, 81))
    assert browser.eval("document.getElementById('rank-title').textContent") == "Rank 5"
    browser.screenshot(ARTIFACTS / "job_faulty_rank5.png")

    # ---- a job with several groups: the groups x steps picture names the group that is off ----
    browser.goto(url(c, "/job/web-groups"))
    worst = browser.wait_for(
        "window.rankscope.groups && window.rankscope.groups.length === 4 && "
        "window.rankscope.worstGroup",
        30,
        "the groups picture",
    )
    assert worst == "g2"
    assert (
        browser.eval("document.querySelector('#groups-list li[data-worst=\"true\"]').dataset.group")
        == "g2"
    )
    browser.screenshot(ARTIFACTS / "job_groups.png")
    # One group's page, by ?group=.
    browser.goto(url(c, "/job/web-groups?group=g2"))
    flagged = json.loads(
        browser.wait_for(
            "window.rankscope.flagged && JSON.stringify(window.rankscope.flagged)",
            30,
            "group g2's heatmap",
        )
    )
    assert flagged["outlier"] == [1], flagged  # global rank 9 is rank 1 of group g2
    assert browser.console == [], browser.console


def test_page_updates_while_a_job_runs(web_collector, browser):
    c = web_collector
    proc = loadgen(
        c, "web-live", "--ranks=8", "--duration=300s", "--step_interval=50ms", background=True
    )
    try:
        browser.goto(url(c, "/job/web-live"))
        first = browser.wait_for("window.rankscope.lastStep", 60, "the first steps on the page")
        browser.eval("window.__not_reloaded = true")
        target = first + 20
        last = browser.wait_for(
            f"window.rankscope.lastStep >= {target} && window.rankscope.lastStep",
            90,
            f"the page to show step {target} without a reload",
        )
        assert browser.eval("window.__not_reloaded === true")
        assert last >= target
        # What the page shows is what the collector stored.
        stored = c.query("SELECT MAX(step) FROM step_stats WHERE job = 'web-live'")[0][0]
        assert stored >= last
        assert browser.eval("window.rankscope.matrix.steps.length") > 0
        browser.screenshot(ARTIFACTS / "job_live.png")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_1024_rank_job_renders(web_collector, browser):
    c = web_collector
    finish(
        [
            loadgen(
                c,
                "web-1024",
                "--ranks=1024",
                "--steps=120",
                "--sketch_dim=64",
                "--step_interval=50ms",
                "--outlier_rank=1000",
                "--outlier_from_step=1",
                "--silent_rank=700",
                "--silent_from_step=60",
            )
        ],
        timeout=300,
    )
    wait_until(
        lambda: (
            c.query("SELECT COUNT(*) FROM step_stats WHERE job = 'web-1024' AND step = 120")[0][0]
            == 1
        ),
        60,
        "the last step stored",
    )
    started = time.monotonic()
    browser.goto(url(c, "/job/web-1024"))
    state = json.loads(
        browser.wait_for(
            "window.rankscope.firstHeatmapAt && JSON.stringify({flagged: window.rankscope.flagged, "
            "world: window.rankscope.matrix.world_size, steps: window.rankscope.matrix.steps.length, "
            "first_heatmap_ms: window.rankscope.firstHeatmapAt, "
            "heatmap_ms: window.rankscope.heatmapMs, fetch_ms: window.rankscope.fetchMs, "
            "canvas_h: document.getElementById('heatmap').height})",
            120,
            "the 1,024-rank heatmap",
        )
    )
    wall_s = time.monotonic() - started
    assert state["world"] == 1024 and state["steps"] == 120
    assert state["canvas_h"] >= 1024  # at least one pixel row per rank
    assert state["flagged"]["missing"] == [700] and 1000 in state["flagged"]["outlier"], state
    # Re-draws of the same data (the refresh path), measured in the page.
    redraw = json.loads(
        browser.eval(
            "(() => { const t = []; for (let i = 0; i < 5; i++) { const t0 = performance.now(); "
            "document.getElementById('metric').value = i % 2 ? 'cosine' : 'outlier'; "
            "document.getElementById('metric').dispatchEvent(new Event('change')); "
            "t.push(performance.now() - t0); } return JSON.stringify(t); })()"
        )
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.screenshot(ARTIFACTS / "job_1024.png")
    measurement = {
        "first_heatmap_ms_since_navigation": state["first_heatmap_ms"],
        "api_fetch_ms": state["fetch_ms"],
        "heatmap_draw_ms": state["heatmap_ms"],
        "redraw_ms": redraw,
        "test_wall_s_to_heatmap": wall_s,
        "ranks": 1024,
        "steps": 120,
    }
    (ARTIFACTS / "render_1024.json").write_text(json.dumps(measurement, indent=2) + "\n")
    print("1,024-rank render:", json.dumps(measurement))


def test_token_is_asked_for_and_sent(tmp_path, browser):
    """With --auth_token_file the API refuses the page until the person gives the token, which
    the page then sends with every request (the pages themselves hold no data)."""
    token = tmp_path / "token"
    token.write_text("web-s3cret\n")
    c = Collector(tmp_path, step_timeout="1s", extra_args=[f"--auth_token_file={token}"]).start()
    try:
        finish([loadgen(c, "web-token", "--ranks=4", "--steps=10", f"--auth_token_file={token}")])
        browser.goto(url(c, "/"))
        browser.wait_for("!!document.getElementById('token-form')", 30, "the token form")
        assert browser.eval("document.querySelectorAll('#jobs-body tr[data-key]').length") == 0
        browser.eval(
            "document.getElementById('token-input').value = 'wrong'; "
            "document.querySelector('#token-form button').click()"
        )
        browser.wait_for(
            "document.getElementById('token-form') && "
            "document.getElementById('token-form').textContent.includes('refused')",
            30,
            "the wrong token refused",
        )
        browser.eval(
            "document.getElementById('token-input').value = 'web-s3cret'; "
            "document.querySelector('#token-form button').click()"
        )
        browser.wait_for(
            "!!document.querySelector('#jobs-body tr[data-key=\"web-token\"]')",
            30,
            "the job listed once the token is given",
        )
    finally:
        c.stop()
