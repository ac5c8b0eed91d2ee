"""`parashift data`: tokenize text into a token file (``prepare``) and check one (``check``)."""
from __future__ import annotations

import argparse

from .outputs import check_output

HELP = "tokenize text files into a memory-mapped token file, or check one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(p))
    pr = sub.add_parser("prepare", help="tokenize FILES with a local tokenizer.json into PATH.bin + PATH.json")
    pr.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files")
    pr.add_argument("--tokenizer", required=True, metavar="DIR",
                    help="a folder holding tokenizer.json (or the file itself); nothing is downloaded")
    pr.add_argument("--out", required=True, metavar="PATH", help="the token file to write, NAME.bin (NAME.json beside it)")
    pr.add_argument("--split", default="file", choices=("file", "paragraph", "line"),
                    help="one document per file (default), per blank-line paragraph, or per line")
    pr.add_argument("--eos", default=None, metavar="TOKEN",
                    help="the end-of-text token appended after each document (default: the tokenizer's usual one)")
    ck = sub.add_parser("check", help="check a token file against its sidecar (size, offsets, SHA-256)")
    ck.add_argument("path", metavar="PATH", help="a NAME.bin written by `parashift data prepare`")
    ck.add_argument("--seq-len", type=int, default=None, help="also count the sequences of this length")
    for q in (pr, ck):
        q.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> dict:
    from ..data import open_tokens, prepare
    if args.action == "prepare":
        check_output(args.out, "file", "--out")
        meta = prepare(args.files, args.tokenizer, args.out, split=args.split, eos=args.eos)
        return {"action": "prepare", "path": args.out, **_summary(meta)}
    tf = open_tokens(args.path, seq_len=args.seq_len, checksum=True)
    out = {"action": "check", "path": args.path, "ok": True, **_summary(tf.meta)}
    if args.seq_len:
        out["seq_len"], out["sequences"] = args.seq_len, tf.num_sequences(args.seq_len)
    return out


def _summary(meta: dict) -> dict:
    return {k: meta[k] for k in ("tokens", "documents", "dtype", "vocab_size", "eos_id", "bytes", "sha256")}


def render(result: dict, args: argparse.Namespace) -> None:
    verb = "wrote" if result["action"] == "prepare" else "ok:"
    print(f"{verb} {result['path']}: {result['tokens']} {result['dtype']} tokens in {result['documents']} "
          f"documents (vocab {result['vocab_size']}, eos {result['eos_id']}), sha256 {result['sha256'][:16]}")
    if "sequences" in result:
        print(f"{result['sequences']} sequences of {result['seq_len']} + 1 tokens")
