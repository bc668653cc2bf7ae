#!/usr/bin/python3
"""Runs every command and snippet of a Markdown tutorial, in order, in one folder.

    run_tutorial.py DOC --build BUILD --source SRC [--work DIR] [--update]

Fenced blocks tagged sh, python or cpp run as written, in the order of the
document and in one working folder (a fresh temporary one unless --work), so
that a later block may read what an earlier one wrote:
  sh      bash -euo pipefail, with the mha program (BUILD) first on PATH;
  python  the interpreter running this script, PYTHONPATH=BUILD/python, MPLBACKEND=Agg;
  cpp     g++ -std=c++20 against SRC/include and BUILD/libmha, then run.
A block that fails (exit status, compile error) fails the run, naming its line.
Every picture the document shows, ![...](tutorial/NAME.png), must have been
written by the blocks as NAME.png in the working folder (a PNG file).

--update copies those pictures into the document's tutorial/ folder and puts
each runnable block's output into the ```text block that follows it (the
last 24 lines), so the document shows what its commands printed.
"""
import argparse
import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

RUNNABLE = ("sh", "python", "cpp")
MAX_OUTPUT_LINES = 24


def blocks(lines):
    """[(lang, first line index, last line index, body)] of the fenced blocks."""
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            sys.exit(f"unclosed block at line {i + 1}")
        out.append((m.group(1), i, j, "".join(lines[i + 1:j])))
        i = j + 1
    return out


def run_block(lang, body, n, args, env, work):
    if lang == "sh":
        cmd = ["bash", "-euo", "pipefail", "-c", body]
    elif lang == "python":
        path = os.path.join(work, f".tutorial_{n}.py")
        open(path, "w").write(body)
        cmd = [sys.executable, path]
    else:
        src, exe = os.path.join(work, f".tutorial_{n}.cpp"), os.path.join(work, f".tutorial_{n}")
        open(src, "w").write(body)
        build = subprocess.run(["g++", "-std=c++20", "-O2", src, "-o", exe, f"-I{args.source}/include",
                                f"-L{args.build}", "-lmha", f"-Wl,-rpath,{args.build}"],
                               capture_output=True, text=True)
        if build.returncode != 0:
            return build.returncode, build.stdout + build.stderr
        cmd = [exe]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("doc")
    p.add_argument("--build", required=True, help="the build folder (the mha program, libmha, python/)")
    p.add_argument("--source", required=True, help="the source folder (include/)")
    p.add_argument("--work", help="the working folder (default: a fresh temporary one)")
    p.add_argument("--update", action="store_true", help="write the pictures and outputs back into the document")
    args = p.parse_args()
    args.build, args.source = os.path.abspath(args.build), os.path.abspath(args.source)
    if args.work:
        work = os.path.abspath(args.work)
        os.makedirs(work, exist_ok=True)
    else:
        work = tempfile.mkdtemp(prefix="mha_tutorial_")
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    env = dict(os.environ, PATH=args.build + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.path.join(args.build, "python"), MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")

    lines = open(args.doc).readlines()
    found = blocks(lines)
    outputs = {}  # index of a text block -> the output that belongs in it
    ran, started = 0, time.time()
    for n, (lang, first, last, body) in enumerate(found):
        if lang not in RUNNABLE:
            continue
        t = time.time()
        status, output = run_block(lang, body, n, args, env, work)
        print(f"line {first + 1}: {lang} block {'ok' if status == 0 else 'FAILED'} in {time.time() - t:.1f} s",
              flush=True)
        if status != 0:
            print(f"--- the block at line {first + 1} of {args.doc}:\n{body}--- its output:\n{output}")
            sys.exit(1)
        ran += 1
        nxt = n + 1
        if nxt < len(found) and found[nxt][0] == "text" and all(not l.strip() for l in lines[last + 1:found[nxt][1]]):
            shown = output.rstrip("\n").splitlines()
            if len(shown) > MAX_OUTPUT_LINES:
                shown = ["…"] + shown[-MAX_OUTPUT_LINES:]
            outputs[nxt] = shown

    pictures = re.findall(r"!\[[^\]]*\]\(tutorial/([\w.-]+\.png)\)", "".join(lines))
    for name in pictures:
        path = os.path.join(work, name)
        if not os.path.exists(path) or open(path, "rb").read(8) != b"\x89PNG\r\n\x1a\n":
            sys.exit(f"the document shows tutorial/{name}, which no block wrote as a PNG file in {work}")
    print(f"tutorial ok: {ran} blocks ran in {time.time() - started:.0f} s, {len(pictures)} pictures written")

    if args.update:
        folder = os.path.join(os.path.dirname(os.path.abspath(args.doc)), "tutorial")
        os.makedirs(folder, exist_ok=True)
        for name in pictures:
            shutil.copyfile(os.path.join(work, name), os.path.join(folder, name))
        for n in sorted(outputs, reverse=True):
            _, first, last, _ = found[n]
            lines[first + 1:last] = [l + "\n" for l in outputs[n]]
        open(args.doc, "w").writelines(lines)
        print(f"updated {args.doc}: {len(outputs)} outputs, {len(pictures)} pictures in {folder}")


if __name__ == "__main__":
    main()
