"""The default data is the same on every machine that installed the lock: its corpus reads only locked packages, the
locks agree with the ranges and with each other, the built files' digest is README.md's, and a mismatch names the
package versions that differ."""
import importlib.metadata
import json
import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO
import make_sample_corpus
import prepare_default_data


def read_lock(name):
    return prepare_default_data.locked_versions(os.path.join(REPO, name))


def range_requirements(name):
    """The Requirement of each package line of a human-edited requirements file (-r lines followed)."""
    requirements = []
    for line in open(os.path.join(REPO, name)):
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            requirements += range_requirements(line[3:].strip())
        elif line:
            requirements.append(Requirement(line))
    return requirements


def test_built_default_data_has_the_readmes_digest(webtext_data):
    """The suite installs requirements-test.lock, whose runtime pins are the runtime lock's: the data built from it
    is byte for byte the one README.md's numbers came from."""
    digest = prepare_default_data.data_digest(webtext_data)
    assert digest == prepare_default_data.DEFAULT_DATA_DIGEST
    assert prepare_default_data.check_digest(digest) is None
    assert f"default data digest: `{digest}`" in open(os.path.join(REPO, "README.md")).read()


def test_corpus_holds_only_locked_packages_sources(webtext_data):
    """No standard-library or torch document (they follow the Python and the user's torch), and every package the
    corpus reads is a distribution pinned in requirements.lock."""
    labels = {json.loads(line)["url"].split("/")[2] for line in open(os.path.join(webtext_data, "webtext.json"))}
    assert labels <= set(make_sample_corpus.SOURCE_PACKAGES) and len(labels) >= 20, labels   # kiwisolver: no docs
    lock = read_lock("requirements.lock")
    owners = importlib.metadata.packages_distributions()
    for name in make_sample_corpus.SOURCE_PACKAGES:
        assert any(prepare_default_data.normalise(dist) in lock for dist in owners[name]), name
    assert "torch" not in lock


@pytest.mark.parametrize("name", ["zope.interface", "zope-interface", "Zope_Interface", "ZOPE.interface",
                                  "ruamel.yaml.clib", "a__b", "a-_.b", " PyYAML "])
def test_package_names_are_normalised_as_pep_503(name):
    """A dotted, underscored or upper-case spelling names the same package: each run of '-', '_', '.' is one '-'
    (packaging's canonicalize_name is PEP 503's reference; no lock of today pins a dotted name)."""
    assert prepare_default_data.normalise(name) == canonicalize_name(name.strip())


def test_a_dotted_pin_is_found_under_every_spelling(tmp_path):
    """A lock's `zope.interface==` pin is the `zope-interface` and `Zope_Interface` a requirements range names."""
    lock = tmp_path / "requirements.lock"
    lock.write_text("zope.interface==7.2\nruamel.yaml==0.18.6\n")
    pins = prepare_default_data.locked_versions(str(lock))
    assert pins == {"zope-interface": "7.2", "ruamel-yaml": "0.18.6"}
    for spelling in ("zope.interface", "zope-interface", "Zope_Interface"):
        assert pins[prepare_default_data.normalise(spelling)] == "7.2", spelling


def test_locks_pin_every_package_within_its_range():
    """Both locks pin exact versions (no torch: a GPU user's is kept), every range of requirements*.txt is satisfied
    by its lock, and the runtime lock is the test lock's subset at the same versions."""
    runtime, test = read_lock("requirements.lock"), read_lock("requirements-test.lock")
    for lock_name, ranges, lock in (("requirements.lock", "requirements.txt", runtime),
                                    ("requirements-test.lock", "requirements-test.txt", test)):
        lines = [line for line in open(os.path.join(REPO, lock_name)) if line.strip() and not line.startswith("#")]
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[^=\s]+\n", line) for line in lines), lock_name
        for requirement in range_requirements(ranges):
            if requirement.name == "torch":
                assert requirement.name not in lock
                continue
            version = lock[prepare_default_data.normalise(requirement.name)]
            assert requirement.specifier.contains(version, prereleases=True), (requirement, version)
    assert {name: test[name] for name in runtime} == runtime


def test_installed_versions_are_the_locks():
    """make test installed requirements-test.lock: nothing this run imports follows the index's newest release."""
    assert prepare_default_data.version_differences(read_lock("requirements-test.lock")) == []


def test_a_digest_mismatch_is_one_line_naming_the_versions_that_differ(tmp_path):
    numpy_version = importlib.metadata.version("numpy")
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"# header\nnumpy=={numpy_version}\nPyYAML==0.0.1\nno_such_package==1.0\n")
    assert prepare_default_data.check_digest("abc", expected="abc", lock_file=str(lock)) is None
    warning = prepare_default_data.check_digest("abc", expected="def", lock_file=str(lock))
    yaml_version = importlib.metadata.version("PyYAML")
    assert warning == (f"warning: default data digest abc is not README.md's def: package versions differ from "
                       f"requirements.lock: no-such-package missing (lock 1.0), pyyaml {yaml_version} (lock 0.0.1) "
                       f"(make install installs the lock; then make clean-data data)")
    lock.write_text(f"numpy=={numpy_version}\n")
    assert prepare_default_data.check_digest("abc", expected="def", lock_file=str(lock)).endswith(
        ": the installed versions equal requirements.lock")


@pytest.mark.parametrize("flags, warned", [([], True), (["--vocab-size", "4096"], False),
                                           (["--corpus-mb", "2"], False)])
def test_digest_warning_only_for_the_default_data(tmp_path, capsys, flags, warned):
    """Built files (five placeholders: every build step is skipped) whose digest is not README.md's: one warning
    line for the default data; another vocabulary or corpus size is other data, with a digest of its own."""
    for name in prepare_default_data.DATA_FILES:
        (tmp_path / name).write_bytes(name.encode())
    prepare_default_data.main(["--output-dir", str(tmp_path), *flags])
    captured = capsys.readouterr()
    assert "[1/3] corpus: exists" in captured.out and "[3/3] preprocess: exists" in captured.out
    digest = prepare_default_data.data_digest(str(tmp_path))
    assert f"default data digest: {digest}\n" in captured.out
    expected = f"warning: default data digest {digest} is not README.md's {prepare_default_data.DEFAULT_DATA_DIGEST}: "
    warnings = [line for line in captured.err.splitlines() if "digest" in line]
    assert len(warnings) == int(warned) and all(line.startswith(expected) for line in warnings), captured.err


def test_digest_covers_every_file_and_its_name(tmp_path):
    """One changed byte in any of the five files, or two files' contents swapped, changes the digest."""
    for name in prepare_default_data.DATA_FILES:
        (tmp_path / name).write_bytes(b"x")
    first = prepare_default_data.data_digest(str(tmp_path))
    assert re.fullmatch(r"[0-9a-f]{16}", first)
    for name in prepare_default_data.DATA_FILES:
        (tmp_path / name).write_bytes(b"y")
        assert prepare_default_data.data_digest(str(tmp_path)) != first, name
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "vocab.json").write_bytes(b"a")
    (tmp_path / "merges.txt").write_bytes(b"b")
    swapped_from = prepare_default_data.data_digest(str(tmp_path))
    (tmp_path / "vocab.json").write_bytes(b"b")
    (tmp_path / "merges.txt").write_bytes(b"a")
    assert prepare_default_data.data_digest(str(tmp_path)) != swapped_from


def test_package_dir_finds_without_importing():
    assert make_sample_corpus.package_dir("nltk").endswith(os.path.join("site-packages", "nltk"))
    assert make_sample_corpus.package_dir("no_such_package_here") is None


@pytest.mark.parametrize("target", ["install", "install-test", "test"])
def test_make_installs_the_locks_not_the_ranges(target):
    """Every pip install of the Makefile's install and test targets reads a lock (or the CPU torch pin)."""
    makefile = open(os.path.join(REPO, "Makefile")).read()
    body = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    installs = re.findall(r"pip install [^&;\n]*", body)
    assert installs and all(re.search(r"-r requirements(-test)?\.lock|-r requirements-torch-cpu\.txt", line)
                            for line in installs), installs
