"""docs/ARCHITECTURE.md against the source tree (issue 30): cheap, pure Python, no build.

- Every repository path the document writes in backticks exists (brace lists such as
  `collector/store/sqlite_{store,schema}.{h,cc}` and globs such as `tests/tsan*` are expanded).
- The collector's pure core is the list of collector/ paths in the document's paragraph that
  starts with "The collector's pure core". No file in it includes SQLite, gRPC, civetweb, prometheus-cpp or
  thread headers, nor a collector header outside the pure core (the store, ingest, query, web
  server and metrics edges). The CMake configuration enforces the same rule on the link lines
  (rankscope_check_pure in collector/CMakeLists.txt).

    .venv/bin/python -m pytest -q tests/ops/test_architecture.py
"""

import itertools
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"

# Top-level folders whose paths the document may name; a backticked span starting with one of
# them is taken as a path (so `/metrics`, `window.rankscope` or `build/bin/...` are not).
ROOTS = (
    "agent",
    "bench",
    "collector",
    "common",
    "dashboards",
    "deploy",
    "docs",
    "proto",
    "tests",
    "tools",
    "trainer_shim",
)
PATH_SPAN = re.compile(r"^[A-Za-z0-9_.*{},/-]+$")
PURE_PARAGRAPH = "The collector's pure core"

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)
# Includes a pure file may not have, whatever it is: the edges' libraries and threads.
FORBIDDEN = (
    re.compile(r"(^|/)sqlite3\.h$"),
    re.compile(r"grpc"),  # grpcpp/..., grpc/..., *.grpc.pb.h (the messages' *.pb.h is fine)
    re.compile(r"civetweb"),
    re.compile(r"^prometheus/"),
    re.compile(r"^(thread|mutex|shared_mutex|condition_variable|future)$"),
    re.compile(r"^common/mutex\.h$"),
)


def expand(span):
    """The paths a span names: `a/{b,c}.{h,cc}` -> a/b.h, a/b.cc, a/c.h, a/c.cc."""
    parts = re.split(r"\{([^}]*)\}", span)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def backticked_paths(text):
    for span in re.findall(r"`([^`\n]+)`", text):
        if not PATH_SPAN.match(span) or span.split("/")[0] not in ROOTS or "/" not in span:
            continue
        yield span


def exists(path):
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def pure_paths():
    text = ARCHITECTURE.read_text()
    paragraph = next(
        (p for p in re.split(r"\n\s*\n", text) if p.lstrip().startswith(PURE_PARAGRAPH)), None
    )
    assert paragraph, f'docs/ARCHITECTURE.md has no paragraph starting "{PURE_PARAGRAPH}"'
    spans = [span for span in backticked_paths(paragraph) if span.startswith("collector/")]
    return [path for span in spans for path in expand(span)]


def pure_files():
    files = set()
    for path in pure_paths():
        full = REPO / path
        if full.is_dir():
            files.update(f for f in full.rglob("*") if f.suffix in (".h", ".cc"))
        elif full.suffix in (".h", ".cc"):
            files.add(full)
    return sorted(files)


def test_every_path_named_in_architecture_md_exists():
    spans = list(backticked_paths(ARCHITECTURE.read_text()))
    assert len(spans) > 50, "the path pattern no longer finds the document's paths"
    missing = [(span, path) for span in spans for path in expand(span) if not exists(path)]
    assert not missing, "docs/ARCHITECTURE.md names paths that do not exist:\n" + "\n".join(
        f"  `{span}`: {path}" for span, path in missing
    )


def test_pure_core_is_declared():
    paths = pure_paths()
    for path in (
        "collector/model/",
        "collector/analysis/",
        "collector/pipeline/step_joiner.h",
        "collector/ingest/validation.h",
        "collector/web/web_api.h",
    ):
        assert path in paths, f"{path} is no longer in the pure core's paragraph"
    assert not [p for p in paths if not (REPO / p).exists()]


@pytest.mark.parametrize("path", pure_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_pure_core_includes_no_edge(path):
    pure = {str(f.relative_to(REPO)) for f in pure_files()}
    bad = []
    for header in INCLUDE.findall(path.read_text()):
        if any(pattern.search(header) for pattern in FORBIDDEN):
            bad.append(f"{header} (an edge library or threads)")
        elif header.startswith("collector/") and header not in pure:
            bad.append(f"{header} (a collector header outside the pure core)")
    assert not bad, f"{path.relative_to(REPO)} is in the pure core but includes " + ", ".join(bad)


def test_pure_libraries_named_are_those_the_build_checks():
    """The pure libraries the pure core's paragraph lists are rankscope_check_pure's arguments."""
    text = ARCHITECTURE.read_text()
    paragraph = next(p for p in re.split(r"\n\s*\n", text) if p.lstrip().startswith(PURE_PARAGRAPH))
    listed = re.search(r"the pure libraries \(([^)]*)\)", paragraph)
    assert listed, "the pure core's paragraph no longer lists the pure libraries"
    documented = {
        span.removeprefix("rankscope::") for span in re.findall(r"`([^`]+)`", listed.group(1))
    }
    cmake = (REPO / "collector" / "CMakeLists.txt").read_text()
    call = re.search(r"^rankscope_check_pure\(([^)]*)\)", cmake, re.MULTILINE)
    assert call, "collector/CMakeLists.txt no longer calls rankscope_check_pure"
    checked = {name.removeprefix("rankscope::") for name in call.group(1).split()}
    assert documented == checked, (
        f"only in docs/ARCHITECTURE.md: {sorted(documented - checked)}; "
        f"only in rankscope_check_pure: {sorted(checked - documented)}"
    )
