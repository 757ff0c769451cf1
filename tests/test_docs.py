"""The README a newcomer reads and the docs it links: short, every relative link and anchor
resolves (in README.md and docs/*.md), every doc is one link away from the README, and the
README's example runs as written. Each checker has a negative control."""
import contextlib
import io
import re
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(path: Path) -> list[str]:
    """Relative link targets outside code blocks (web addresses are not checked here)."""
    text = FENCE.sub("", path.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def broken(path: Path) -> list[str]:
    """The links in ``path`` whose file, or whose ``#anchor`` in that file, does not exist."""
    bad = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    return bad


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_no_broken_relative_links():
    found = {p.relative_to(ROOT).as_posix(): broken(p) for p in [README, *DOCS]}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_link_check_finds_broken_links(tmp_path):
    """Negative control: a missing file and a missing anchor are both reported."""
    (tmp_path / "other.md").write_text("# A heading (with `code`)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code) [gone](missing.md) [bad](other.md#nope)\n"
                    "```\n[in code](ignored.md)\n```\n[web](https://example.org/x.md)\n")
    assert broken(page) == ["missing.md: no such file", "other.md#nope: no heading '#nope' in other.md"]


def test_every_doc_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README)}
    assert [d.name for d in DOCS if d.resolve() not in linked] == []


def test_the_readme_example_runs_and_trains():
    """The "Use it from your own Flax code" block, as written: ZeRO-3 over the 8 devices (the
    stack's optimizer state split eight ways), and the loss after 20 steps under half the initial."""
    code = re.search(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S).group(1)
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md", "exec"), namespace)
    state, metrics = namespace["state"], namespace["metrics"]
    assert out.getvalue().startswith("step 20: loss ")
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 3]  # the stack's Adam m and v
    assert moments and all(x.addressable_shards[0].data.size == x.size // jax.device_count() for x in moments)
    import jzero

    x = namespace["x"]
    first = jzero.init(namespace["init_fn"], namespace["cfg"], loss_fn=namespace["loss_fn"], rng=0)
    before = float(jzero.eval_step(first, {"inputs": x, "y": np.sin(x).sum(1, keepdims=True)}))
    assert float(metrics["loss"]) < 0.5 * before


def test_the_lora_demo_trains_only_the_adapters():
    """docs/api.md's LoRA block, as written: the frozen GPT is unchanged bit for bit, only the
    adapters hold optimizer state, and the adapters moved."""
    text = (ROOT / "docs" / "api.md").read_text()
    code = re.search(r"^### LoRA.*?^```python\n(.*?)^```", text, re.M | re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/api.md", "exec"), namespace)
    import jzero

    state = namespace["state"]
    first = jzero.init(namespace["init_fn"], namespace["cfg"], loss_fn=namespace["loss_fn"], rng=0).params
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state.params["base"],
                 first["base"])
    assert float(np.abs(np.asarray(state.params["lora"]["b"])).max()) > 0
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 3]
    assert sorted(x.shape for x in moments) == sorted([first["lora"]["a"].shape, first["lora"]["b"].shape] * 2)
