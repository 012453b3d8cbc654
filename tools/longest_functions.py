"""The longest functions of the package at a git revision (an AST count of lines), for the layout reports:

    python3 tools/longest_functions.py HEAD [--top 8] [--limit 80]
"""

import argparse
import ast
import subprocess


def functions(rev: str, root: str = "src/hf_lookaround") -> list[tuple[int, str]]:
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, root], capture_output=True, text=True,
                           check=True).stdout.split()
    rows = []
    for name in (n for n in names if n.endswith(".py")):
        source = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True, text=True, check=True).stdout
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                rows.append((node.end_lineno - node.lineno + 1, f"{name.removeprefix(root + '/')}:{node.name}"))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", default="HEAD")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--limit", type=int, default=80, help="count the functions longer than this")
    args = parser.parse_args()
    rows = functions(args.rev)
    print(f"{args.rev}: {len(rows)} functions, {sum(n > args.limit for n, _ in rows)} over {args.limit} lines")
    for n, name in rows[: args.top]:
        print(f"  {n:4d} {name}")


if __name__ == "__main__":
    main()
