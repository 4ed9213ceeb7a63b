"""docs/ARCHITECTURE.md against the source tree (issue 30): cheap, pure Python, no build.

- Every repository path the document writes in backticks exists (brace lists such as
  `collector/store/sqlite_{store,schema}.{h,cc}` and globs such as `tests/tsan*` are expanded).
- The collector's pure core is the list of collector/ paths in the document's paragraph that
  starts with "The collector's pure core". No file in it includes SQLite, gRPC, civetweb, prometheus-cpp or
  thread headers, nor a collector header outside the pure core (the store, ingest, query, web
  server and metrics edges). The CMake configuration enforces the same rule on the link lines
  (rankscope_check_pure in collector/CMakeLists.txt).
- The floors: no C/C++ file of common/, proto/, the Query client, agent/, collector/, tools/ or
  trainer_shim/ includes a header of a floor above its own.
- The pure libraries' link lines (collector/CMakeLists.txt) name only what the paragraph allows,
  and those it says "do without the wire messages" neither link them nor include rankscope/v1/.
- The names it gives exist: every `rs-*` thread name is a string in the code, every `--flag` is
  defined (ABSL_FLAG, argparse or a build file), every `rankscope::lib` is a CMake alias, every
  `Class::member` is named in the file that defines Class, every bare file name is in the tree.

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


# ---- the floors: no file includes one from a floor above it ----------------------------------

SOURCE_SUFFIXES = (".h", ".cc", ".c")
AGENT_PUBLIC = re.compile(r"^rankscope/[a-z_]+\.h$")  # agent/include/rankscope/*.h
FLOOR_NAMES = (
    "common/",
    "proto/",
    "the Query client",
    "agent/",
    "collector/",
    "tools/ and trainer_shim/",
)


def tracked_sources(*roots):
    return sorted(
        f
        for root in roots
        for f in (REPO / root).rglob("*")
        if f.suffix in SOURCE_SUFFIXES and f.is_file()
    )


def floor_of_file(path):
    rel = str(path.relative_to(REPO))
    if rel.startswith("common/query_client."):
        return 2
    for floor, prefix in ((0, "common/"), (1, "proto/"), (3, "agent/"), (4, "collector/")):
        if rel.startswith(prefix):
            return floor
    return 5  # tools/, trainer_shim/


def floor_of_include(header, including):
    """The floor a project include belongs to, or None for a library's (Abseil, gRPC, ...)."""
    if header.startswith("common/query_client."):
        return 2
    if header.startswith("common/"):
        return 0
    if header.startswith("rankscope/v1/"):
        return 1  # generated from proto/
    if AGENT_PUBLIC.match(header):
        return 3
    if header.startswith("collector/"):
        return 4
    if header.startswith(("tools/", "trainer_shim/")):
        return 5
    if "/" not in header and (including.parent / header).exists():
        return floor_of_file(including)  # a private header beside it
    return None


def test_architecture_md_states_the_floor_rule():
    text = " ".join(ARCHITECTURE.read_text().split())
    assert "No file includes one from a floor above it." in text


@pytest.mark.parametrize("root", ["common", "agent", "collector", "tools", "trainer_shim"])
def test_no_file_includes_one_from_a_floor_above_it(root):
    files = tracked_sources(root)
    assert files, f"no C/C++ sources under {root}/"
    bad = []
    for path in files:
        mine = floor_of_file(path)
        for header in INCLUDE.findall(path.read_text(errors="replace")):
            theirs = floor_of_include(header, path)
            if theirs is not None and theirs > mine:
                bad.append(
                    f"{path.relative_to(REPO)} ({FLOOR_NAMES[mine]}) includes {header} "
                    f"({FLOOR_NAMES[theirs]})"
                )
    assert not bad, "docs/ARCHITECTURE.md's floors are broken:\n" + "\n".join(bad)


# ---- the pure libraries' link lines, as the paragraph states them ------------------------------

COLLECTOR_CMAKE = REPO / "collector" / "CMakeLists.txt"


def cmake_calls(name, text):
    """{first argument: the rest} of every `name(...)` call in a CMake file."""
    calls = {}
    for m in re.finditer(rf"^{name}\(([^)]*)\)", text, re.MULTILINE):
        words = m.group(1).split()
        calls.setdefault(words[0], []).extend(words[1:])
    return calls


def pure_libraries():
    call = re.search(r"^rankscope_check_pure\(([^)]*)\)", COLLECTOR_CMAKE.read_text(), re.MULTILINE)
    return [name.removeprefix("rankscope::") for name in call.group(1).split()]


def pure_paragraph():
    text = ARCHITECTURE.read_text()
    return next(p for p in re.split(r"\n\s*\n", text) if p.lstrip().startswith(PURE_PARAGRAPH))


def test_pure_libraries_link_only_what_the_paragraph_allows():
    """ "the pure libraries link only Abseil, [common/'s] ... and the wire messages": each pure
    library's own link line names Abseil, other pure libraries and the common/ libraries the
    paragraph names (cpu_isa for collector_core alone)."""
    paragraph = " ".join(pure_paragraph().split())
    allowed_common = {
        "sketch_encoding": "sketch-encoding",
        "job_name": "job-name",
        "common": "`rankscope::common`",
        "proto_messages": "`rankscope::proto_messages`",
    }
    for name, words in allowed_common.items():
        assert words in paragraph, f"the pure core's paragraph no longer allows {name} ({words})"
    pure = set(pure_libraries())
    links = cmake_calls("target_link_libraries", COLLECTOR_CMAKE.read_text())
    bad = []
    for lib in sorted(pure):
        for item in links.get(f"rankscope_{lib}", []):
            if item in ("PUBLIC", "PRIVATE", "INTERFACE") or item.startswith("absl::"):
                continue
            dep = item.removeprefix("rankscope::")
            if dep in pure or dep in allowed_common:
                continue
            if dep == "cpu_isa" and lib == "collector_core":
                continue
            bad.append(f"{lib} links {item}")
    assert not bad, "pure libraries link what docs/ARCHITECTURE.md does not allow: " + ", ".join(
        bad
    )


def test_pure_libraries_without_wire_messages_include_no_generated_header():
    """The libraries the paragraph says "do without the wire messages" neither link
    rankscope::proto_messages nor include a generated rankscope/v1 header in their sources."""
    paragraph = " ".join(pure_paragraph().split())
    m = re.search(r";\s*((?:`[a-z_]+`,?\s*(?:and\s*)?)+)do without the wire messages", paragraph)
    assert m, (
        'the pure core\'s paragraph no longer says which libraries "do without the wire messages"'
    )
    without = re.findall(r"`([a-z_]+)`", m.group(1))
    assert "collector_model" in without and "step_analysis" in without
    cmake = COLLECTOR_CMAKE.read_text()
    sources = cmake_calls("add_library", cmake)
    links = cmake_calls("target_link_libraries", cmake)
    bad = []
    for lib in without:
        if "rankscope::proto_messages" in links.get(f"rankscope_{lib}", []):
            bad.append(f"{lib} links rankscope::proto_messages")
        srcs = [s for s in sources.get(f"rankscope_{lib}", []) if s.endswith(".cc")]
        assert srcs, f"collector/CMakeLists.txt has no sources for rankscope_{lib}"
        for src in srcs:
            for path in (
                COLLECTOR_CMAKE.parent / src,
                (COLLECTOR_CMAKE.parent / src).with_suffix(".h"),
            ):
                if not path.exists():
                    continue
                for header in INCLUDE.findall(path.read_text()):
                    if header.startswith("rankscope/v1/"):
                        bad.append(f"{path.relative_to(REPO)} ({lib}) includes {header}")
    assert not bad, "\n".join(bad)


# ---- names the document gives: threads, flags, libraries, members --------------------------

CODE_ROOTS = ("agent", "collector", "common", "tools", "trainer_shim", "bench", "tests", "proto")


def code_text():
    parts = []
    for root in CODE_ROOTS:
        for f in (REPO / root).rglob("*"):
            if f.is_file() and f.suffix in (
                ".h",
                ".cc",
                ".c",
                ".py",
                ".txt",
                ".cmake",
                ".proto",
                ".in",
            ):
                parts.append(f.read_text(errors="replace"))
    parts.append((REPO / "CMakeLists.txt").read_text())
    parts.append((REPO / "run").read_text())
    return "\n".join(parts)


@pytest.fixture(scope="module")
def code():
    return code_text()


def spans(pattern):
    return sorted(set(re.findall(pattern, ARCHITECTURE.read_text())))


def test_every_thread_named_is_started_under_that_name(code):
    names = spans(r"`(rs-[a-z-]+)`")
    assert len(names) >= 5
    missing = [n for n in names if f'"{n}"' not in code]
    assert not missing, f"docs/ARCHITECTURE.md names threads no code names: {missing}"


def test_every_flag_named_exists(code):
    flags = [re.split(r"[=,]", f)[0] for f in spans(r"`--([a-z][a-z_-]*[^`]*)`")]
    assert len(flags) >= 10
    missing = [
        f
        for f in flags
        if not re.search(rf"ABSL_FLAG\(\s*[\w:<>]+\s*,\s*{re.escape(f)}\s*,", code)
        and f'"--{f}' not in code
        and f"--{f}"
        not in (REPO / "CMakeLists.txt").read_text()
        + (REPO / "trainer_shim" / "CMakeLists.txt").read_text()
    ]
    assert not missing, f"docs/ARCHITECTURE.md names flags nothing defines: {missing}"


def test_every_rankscope_library_named_is_a_cmake_target():
    aliases = set()
    for cmake in REPO.rglob("CMakeLists.txt"):
        if "build" in cmake.relative_to(REPO).parts[0]:
            continue
        aliases.update(re.findall(r"add_library\(\s*rankscope::(\w+)\s+ALIAS", cmake.read_text()))
    named = [n for n in spans(r"`rankscope::([a-z_]+)`")]
    assert named
    missing = [n for n in named if n not in aliases]
    assert not missing, f"docs/ARCHITECTURE.md names libraries CMake does not define: {missing}"


PROJECT_SOURCES = ("agent", "collector", "common", "tools", "trainer_shim/src")


def test_every_member_named_is_declared_by_its_class():
    """`Class::member` (a project class or struct): the file that defines Class names member."""
    defining = {}
    for root in PROJECT_SOURCES:
        for f in tracked_sources(root):
            for cls in re.findall(
                r"^\s*(?:class|struct)\s+(?:ABSL_\w+\s+)?(\w+)\b[^;]*?\{",
                f.read_text(errors="replace"),
                re.MULTILINE,
            ):
                defining.setdefault(cls, []).append(f)
    named = spans(r"`([A-Z]\w*)::(\w+)(?:\(\))?`")
    assert len(named) >= 20
    bad = []
    for cls, member in named:
        files = defining.get(cls)
        if not files:
            bad.append(f"{cls}::{member} (no class or struct {cls})")
            continue
        texts = [f.read_text(errors="replace") for f in files]
        texts += [f.with_suffix(".cc").read_text() for f in files if f.with_suffix(".cc").exists()]
        if not any(re.search(rf"\b{member}\b", t) for t in texts):
            bad.append(
                f"{cls}::{member} (not in {', '.join(str(f.relative_to(REPO)) for f in files)})"
            )
    assert not bad, "docs/ARCHITECTURE.md names members that do not exist:\n" + "\n".join(bad)


# Files the document names that are not in the tree, and why.
NOT_IN_TREE = {
    "sqlite3.h": "SQLite's header (the include rule forbids it)",
    "web_assets.cc": "generated at build time by collector/web/embed_assets.cmake",
}


def test_every_file_named_without_its_folder_exists_somewhere():
    """`_options.py`, `wire.h`, `sketch_buffer_pool.h`: a file of that name is in the tree."""
    names = spans(r"`([A-Za-z0-9_.-]+\.(?:py|h|cc|c|sh|js|html|css|md|yml|in))`")
    assert len(names) >= 20
    have = {f.name for root in ROOTS for f in (REPO / root).rglob("*") if f.is_file()}
    have.update(f.name for f in REPO.iterdir() if f.is_file())
    missing = [n for n in names if n not in have and n not in NOT_IN_TREE]
    assert not missing, f"docs/ARCHITECTURE.md names files that are nowhere: {missing}"
