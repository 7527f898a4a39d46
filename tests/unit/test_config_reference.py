"""The configuration reference (docs/configuration.md) is generated from contracts/config.py's field comments:
one source, no key without a comment, no key left out."""
import dataclasses
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from contracts import config

ROOT = Path(__file__).resolve().parents[2]


def _reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SOURCE = (ROOT / "contracts" / "config.py").read_text()


def test_the_committed_page_is_what_the_config_module_renders():
    ref = _reference()
    assert (ROOT / "docs" / "configuration.md").read_text() == ref.render(SOURCE), (
        "docs/configuration.md differs from contracts/config.py's comments: run "
        "`python scripts/config_reference.py --write`")


def test_every_field_of_every_section_has_a_comment():
    assert _reference().missing_comments(SOURCE) == []


SMALL = textwrap.dedent('''
    import dataclasses

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ModelConfig:
        """The network."""

        arch: str = "llama"            # which network
        hidden_size: int = 64          # model width, continued
                                       # on the next line
        # the comment above a field counts as its own
        num_layers: int = 2
        vocab_size: int = 512

        def __post_init__(self) -> None:
            x: int = 1

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Config:
        model: ModelConfig = ModelConfig()
''')


def test_a_field_without_a_comment_is_found_and_fails_the_render():
    ref = _reference()
    assert ref.missing_comments(SMALL) == ["model.vocab_size"]
    with pytest.raises(ValueError, match="model.vocab_size"):
        ref.render(SMALL)
    commented = SMALL.replace("vocab_size: int = 512", "vocab_size: int = 512          # embedding rows")
    assert ref.missing_comments(commented) == []


def test_comments_are_read_from_the_line_its_continuation_or_the_lines_above():
    (section,) = _reference().parse(SMALL)
    comments = {f.name: f.comment for f in section.fields}
    assert comments == {"arch": "which network", "hidden_size": "model width, continued on the next line",
                        "num_layers": "the comment above a field counts as its own", "vocab_size": ""}
    assert (section.name, section.cls, section.doc) == ("model", "ModelConfig", "The network.")
    assert [f.default for f in section.fields] == ['"llama"', "64", "2", "512"]


def test_the_reference_lists_every_field_the_config_module_defines():
    ref = _reference()
    parsed = {s.name: [f.name for f in s.fields] for s in ref.parse(SOURCE)}
    defined = {f.name: [g.name for g in dataclasses.fields(f.type if isinstance(f.type, type)
                                                           else getattr(config, f.type))]
               for f in dataclasses.fields(config.Config)}
    assert parsed == defined
    page = ref.render(SOURCE)
    for section, names in defined.items():
        assert f"## `[{section}]`" in page
        for name in names:
            assert f"| `{section}.{name}` |" in page


def test_markdown_in_a_comment_is_escaped_outside_its_code_spans():
    text = _reference()._text("under <dir>/cache, a * b | c -> d, see `a <b> * c`")
    assert text == r"under &lt;dir&gt;/cache, a \* b \| c -&gt; d, see `a <b> * c`"
