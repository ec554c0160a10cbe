"""A larger real-text corpus for runs that must not repeat their data: English paragraphs from the docstrings of
installed Python packages, one paragraph a line, no network.

The demo corpus (examples/data/corpus.txt, ~111k tokens at the parity run's 8k vocabulary) is read eleven times
in 300 steps of 8 x 512 tokens, and a 1B model memorizes it (loss below 1): a comparison there measures how fast
each arm memorizes. From numpy, scipy, pandas, sympy, torch and transformers this writes ~10 MB, enough for
300 such steps in less than one epoch:

    python benchmarks/docstring_corpus.py --out /tmp/docstrings.txt
    python benchmarks/fp8_parity.py --sizes llama-1b --train_file /tmp/docstrings.txt --out fp8_parity_docs
"""

import argparse
import ast
import importlib.util
import os
import re

PACKAGES = ("numpy", "scipy", "pandas", "sympy", "torch", "transformers")


def paragraphs(source: str):
    """The prose paragraphs of a module's docstrings: joined lines, without code, tables or parameter lists."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        for block in re.split(r"\n\s*\n", doc):
            lines = [line.strip() for line in block.splitlines()]
            text = " ".join(lines)
            # prose: long enough, mostly letters, no doctest prompts, reST directives or "name : type" lines
            if (len(text) < 80 or ">>>" in text or "::" in text or any(re.match(r"^\w+ : ", line) for line in lines)
                    or sum(c.isalpha() or c == " " for c in text) < 0.85 * len(text)):
                continue
            yield text


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--packages", default=",".join(PACKAGES))
    p.add_argument("--max_mb", type=float, default=10.0)
    args = p.parse_args()
    seen, size = set(), 0
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for name in args.packages.split(","):
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                continue
            root = list(spec.submodule_search_locations)[0]
            for folder, _, files in sorted(os.walk(root)):
                for file in sorted(files):
                    if not file.endswith(".py") or "test" in folder:
                        continue
                    with open(os.path.join(folder, file), encoding="utf-8", errors="ignore") as f:
                        for text in paragraphs(f.read()):
                            if text not in seen:  # the same boilerplate paragraph in many files, once
                                seen.add(text)
                                out.write(text + "\n")
                                size += len(text) + 1
                    if size > args.max_mb * 1e6:
                        break
                if size > args.max_mb * 1e6:
                    break
    os.replace(tmp, args.out)
    print(f"{args.out}: {size / 1e6:.1f} MB, {len(seen):,} paragraphs")


if __name__ == "__main__":
    main()
