#!/usr/bin/env python3
"""Load tests of an OpenAI-compatible completions server (`krasis serve`, llama.cpp's `llama-server`), issue #41.

Python standard library only (the GPU box has no pip packages). Prompts are token ids (`/v1/completions`
takes a list of ids: both servers read it), so that prompt lengths are exact and a conversation's turns
share their prefix token for token; replies ask for `ignore_eos` at temperature 0, so that every stream
runs its `max_tokens` on random weights.

Modes (each prints its figures and, with --json FILE, writes them as JSON):
  load     STREAMS concurrent streaming clients: STREAMS-LONG decode streams (short prompts) start first;
           after --long-delay seconds LONG clients send LONG_TOKENS-token prompts while they decode. Checks
           that every stream ends with [DONE], finish_reason "length" and usage that matches (prompt and
           completion tokens); reports the decoding streams' inter-token latency p50/p99 while the long
           prompts prefill (from the first long request to the last one's first token) and before them.
  scaling  for each N in --levels: N streams at once; aggregate decode tok/s over the time all N decode
           (tokens that arrive between the last stream's first token and the first stream's last token).
  prefix   a TURNS-turn conversation: turn 1 sends a HISTORY-token prompt, each later turn the previous
           prompt plus --turn-tokens new ids (a reply and a question); time to first token per turn, and
           per turn the change of /metrics' krasis_prefix_hits_total and krasis_prefix_reused_tokens_total
           (prompt tokens minus reused ones: the tokens the turn prefilled). Then turn 1 again, which
           reuses its prefix: its greedy reply must equal turn 1's (the cold one).

usage: serve-load.py --url http://127.0.0.1:8000 MODE [options]   (--help lists them)
Exit status: 0 when every check passed, 1 otherwise.
"""

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse


# Whether a stream without usage passes (--lenient-usage: for a server that does not send it).
LENIENT_USAGE = False


def percentile(xs, q):
    """The q-quantile (0..1) of xs, by nearest rank; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class Stream:
    """One streaming completion: timings, text, finish reason, usage."""

    def __init__(self, name, prompt, max_tokens):
        self.name, self.prompt, self.max_tokens = name, prompt, max_tokens
        self.sent = self.first = self.done_at = None
        self.times = []  # arrival time of each chunk that carried text
        self.text = ""
        self.finish = None
        self.usage = None
        self.done = False  # saw [DONE]
        self.error = None

    def problems(self, bos_slack=1):
        """What is wrong with the finished stream (empty when nothing is); without usage in the stream
        only when LENIENT_USAGE (a server that does not send it) is off."""
        if self.error:
            return [f"{self.name}: {self.error}"]
        out = []
        if not self.done:
            out.append(f"{self.name}: no [DONE]")
        if self.finish != "length":
            out.append(f"{self.name}: finish_reason {self.finish!r}, expected 'length' (ignore_eos)")
        if self.usage is None:
            if not LENIENT_USAGE:
                out.append(f"{self.name}: no usage in the stream")
            if len(self.times) > self.max_tokens:
                out.append(f"{self.name}: {len(self.times)} text chunks for max_tokens {self.max_tokens}")
        else:
            ct, pt = self.usage.get("completion_tokens"), self.usage.get("prompt_tokens")
            if ct != self.max_tokens:
                out.append(f"{self.name}: usage.completion_tokens {ct}, asked for {self.max_tokens}")
            if pt is None or not len(self.prompt) <= pt <= len(self.prompt) + bos_slack:
                out.append(f"{self.name}: usage.prompt_tokens {pt}, sent {len(self.prompt)} ids")
            if ct is not None and len(self.times) > ct:
                out.append(f"{self.name}: {len(self.times)} text chunks for {ct} tokens")
        return out


class Client:
    def __init__(self, url, model, timeout):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.base = u.path.rstrip("/")
        self.model, self.timeout = model, timeout

    def conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get(self, path):
        c = self.conn()
        try:
            c.request("GET", self.base + path)
            r = c.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            c.close()

    def metrics(self):
        """/metrics as {name: value} (unlabelled samples; None when the server has none)."""
        try:
            status, text = self.get("/metrics")
        except OSError:
            return None
        if status != 200:
            return None
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            try:
                out[name] = float(value)
            except ValueError:
                pass
        return out

    def stream(self, s):
        """Runs the stream `s` to its end (fills its fields; never raises)."""
        body = {"model": self.model, "prompt": s.prompt, "max_tokens": s.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
        c = self.conn()
        try:
            s.sent = time.monotonic()
            c.request("POST", self.base + "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                s.error = f"HTTP {r.status}: {r.read()[:300]!r}"
                return
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    s.done = True
                    break
                now = time.monotonic()
                v = json.loads(data)
                if v.get("usage"):
                    s.usage = v["usage"]
                for ch in v.get("choices") or []:
                    t = ch.get("text") or ""
                    if t:
                        s.text += t
                        s.times.append(now)
                        if s.first is None:
                            s.first = now
                    if ch.get("finish_reason"):
                        s.finish = ch["finish_reason"]
            s.done_at = time.monotonic()
        except Exception as e:  # noqa: BLE001 - a stream's failure is a finding, not a crash
            s.error = f"{type(e).__name__}: {e}"
        finally:
            c.close()


def run_all(client, streams):
    threads = [threading.Thread(target=client.stream, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    return threads


def ids(rng, n, lo, hi):
    return [rng.randrange(lo, hi) for _ in range(n)]


def gaps(streams, lo=None, hi=None):
    """Inter-token gaps (s) of `streams` whose later chunk arrived within [lo, hi]."""
    out = []
    for s in streams:
        for a, b in zip(s.times, s.times[1:]):
            if (lo is None or b >= lo) and (hi is None or b <= hi):
                out.append(b - a)
    return out


def ms(x):
    return "n/a" if x is None else f"{x * 1000:.1f} ms"


def mode_load(a, client, rng, lo, hi):
    n_long = min(a.long, a.streams)
    decoders = [Stream(f"decode{i}", ids(rng, a.short_tokens, lo, hi), a.decode_tokens)
                for i in range(a.streams - n_long)]
    longs = [Stream(f"long{i}", ids(rng, a.long_tokens, lo, hi), a.long_max_tokens) for i in range(n_long)]
    t0 = time.monotonic()
    threads = run_all(client, decoders)
    # The long prompts arrive once every decoding stream has its first token, plus the delay.
    end = t0 + a.deadline
    while time.monotonic() < end and any(s.first is None and s.error is None and not s.done for s in decoders):
        time.sleep(0.01)
    time.sleep(a.long_delay)
    threads += run_all(client, longs)
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    problems = [p for s in decoders + longs for p in s.problems()]
    unfinished = [s.name for s in decoders + longs if s.done_at is None and s.error is None]
    if unfinished:
        problems.append(f"{len(unfinished)} streams unfinished at the deadline ({a.deadline} s): {unfinished[:5]}")
    w_lo = min((s.sent for s in longs if s.sent), default=None)
    w_hi = max((s.first for s in longs if s.first), default=None)
    during = gaps(decoders, w_lo, w_hi) if w_lo and w_hi else []
    before = gaps(decoders, None, w_lo) if w_lo else gaps(decoders)
    covered = w_hi is not None and all(s.times and s.times[-1] >= w_hi for s in decoders if not s.error)
    if not covered:
        problems.append("some decode streams ended before the long prompts' prefill did: raise --decode-tokens")
    res = {
        "streams": a.streams, "long": n_long, "long_tokens": a.long_tokens, "short_tokens": a.short_tokens,
        "decode_tokens": a.decode_tokens, "ok_streams": sum(1 for s in decoders + longs if not s.problems()),
        "itl_before": {"n": len(before), "p50": percentile(before, 0.5), "p99": percentile(before, 0.99)},
        "itl_during_long": {"n": len(during), "p50": percentile(during, 0.5), "p99": percentile(during, 0.99)},
        "window_s": (w_hi - w_lo) if w_lo and w_hi else None,
        "decoders_cover_window": covered,
        "long_ttft_s": [round(s.first - s.sent, 3) if s.first else None for s in longs],
        "problems": problems,
    }
    d = res["itl_during_long"]
    ratio = d["p99"] / d["p50"] if d["p50"] else None
    res["p99_over_p50_during"] = ratio
    print(f"load: {res['ok_streams']}/{len(decoders) + len(longs)} streams correct; {n_long} prompts of "
          f"{a.long_tokens} tokens while {len(decoders)} streams decode")
    print(f"  decode ITL before the long prompts: p50 {ms(res['itl_before']['p50'])}, p99 {ms(res['itl_before']['p99'])} "
          f"({res['itl_before']['n']} gaps)")
    print(f"  decode ITL while they prefill ({res['window_s'] and round(res['window_s'], 2)} s): p50 {ms(d['p50'])}, "
          f"p99 {ms(d['p99'])} ({d['n']} gaps), p99/p50 {ratio and round(ratio, 2)}"
          + ("" if covered else "  [!] some decode streams ended before the long prompts' prefill did"))
    print(f"  long prompts' TTFT: {res['long_ttft_s']} s")
    return res, problems


def mode_scaling(a, client, rng, lo, hi):
    levels = [int(x) for x in a.levels.split(",")]
    res, problems = {"levels": []}, []
    end = time.monotonic() + a.deadline
    for n in levels:
        if time.monotonic() > end:
            problems.append(f"no time left for {n} streams")
            break
        streams = [Stream(f"s{n}.{i}", ids(rng, a.prompt_tokens, lo, hi), a.decode_tokens) for i in range(n)]
        for t in run_all(client, streams):
            t.join(max(0.0, end - time.monotonic()))
        problems += [p for s in streams for p in s.problems()]
        firsts = [s.first for s in streams if s.first]
        lasts = [s.times[-1] for s in streams if s.times]
        agg = None
        if len(firsts) == n and len(lasts) == n:
            lo_t, hi_t = max(firsts), min(lasts)
            tokens = sum(1 for s in streams for t in s.times if lo_t < t <= hi_t)
            agg = tokens / (hi_t - lo_t) if hi_t > lo_t else None
            if agg is None:
                problems.append(f"{n} streams: no time when all of them decoded (one ended before another "
                                "began): raise --decode-tokens")
        per = [(len(s.times) - 1) / (s.times[-1] - s.first) for s in streams if len(s.times) > 1 and s.times[-1] > s.first]
        row = {"streams": n, "aggregate_decode_tok_s": agg, "mean_stream_tok_s": sum(per) / len(per) if per else None,
               "ttft_p50_s": percentile([s.first - s.sent for s in streams if s.first], 0.5)}
        res["levels"].append(row)
        print(f"scaling: {n:3d} streams: aggregate decode {agg and round(agg, 1)} tok/s "
              f"(per stream {row['mean_stream_tok_s'] and round(row['mean_stream_tok_s'], 2)}), "
              f"TTFT p50 {row['ttft_p50_s'] and round(row['ttft_p50_s'], 3)} s")
    return res, problems


def mode_prefix(a, client, rng, lo, hi):
    history = ids(rng, a.history_tokens, lo, hi)
    prompt, turns, problems = list(history), [], []
    first_text = None
    end = time.monotonic() + a.deadline

    def turn(label, p):
        before = client.metrics()
        s = Stream(label, list(p), a.reply_tokens)
        client.stream(s)
        after = client.metrics()
        problems.extend(s.problems())
        delta = {}
        for k in ("krasis_prefix_hits_total", "krasis_prefix_reused_tokens_total"):
            if before is not None and after is not None and k in before and k in after:
                delta[k] = after[k] - before[k]
        reused = delta.get("krasis_prefix_reused_tokens_total")
        pt = (s.usage or {}).get("prompt_tokens")
        row = {"turn": label, "prompt_tokens": pt, "ttft_s": s.first - s.sent if s.first else None,
               "prefix_hits": delta.get("krasis_prefix_hits_total"), "reused_tokens": reused,
               "prefilled_tokens": (pt - reused) if pt is not None and reused is not None else None}
        print(f"prefix: turn {label:>7}: prompt {pt} tokens, TTFT {ms(row['ttft_s'])}, "
              f"reused {reused if reused is not None else 'n/a'}, prefilled {row['prefilled_tokens']}")
        return row, s

    for k in range(1, a.turns + 1):
        if time.monotonic() > end:
            problems.append(f"no time left for turn {k}")
            break
        row, s = turn(str(k), prompt)
        turns.append(row)
        if k == 1:
            first_text = s.text
            if row["reused_tokens"]:
                problems.append(f"turn 1 reused {row['reused_tokens']} tokens: it is not cold (a prompt of an earlier run?)")
        # The next turn: this prompt, a reply and a question (new ids).
        prompt = prompt + ids(rng, a.turn_tokens, lo, hi)
    again = None
    if first_text is not None and time.monotonic() < end:
        row, s = turn("1 again", history)
        again = row
        if s.text != first_text:
            problems.append(f"turn 1 with its prefix reused wrote {s.text[:80]!r}, cold {first_text[:80]!r}")
    t2 = turns[1]["ttft_s"] if len(turns) > 1 else None
    tl = turns[-1]["ttft_s"] if turns else None
    res = {"history_tokens": a.history_tokens, "turn_tokens": a.turn_tokens, "turns": turns, "turn1_again": again,
           "last_over_turn2_ttft": (tl / t2) if t2 and tl else None,
           "greedy_equal_with_reuse": again is not None and not any("prefix reused" in p for p in problems)}
    print(f"prefix: TTFT turn {len(turns)} / turn 2 = {res['last_over_turn2_ttft'] and round(res['last_over_turn2_ttft'], 2)}; "
          f"greedy reply with reuse equal to the cold one: {res['greedy_equal_with_reuse']}")
    return res, problems


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="model", help="the request's model field")
    p.add_argument("--ids", default="258:4096", help="LO:HI, the range prompt token ids are drawn from")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--deadline", type=float, default=300, help="seconds the mode may take")
    p.add_argument("--timeout", type=float, default=600, help="seconds one HTTP read may wait")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--lenient-usage", action="store_true",
                   help="a stream without usage is not a problem (a server that does not send it)")
    sub = p.add_subparsers(dest="mode", required=True)
    lo_ = sub.add_parser("load")
    lo_.add_argument("--streams", type=int, default=32)
    lo_.add_argument("--long", type=int, default=4, help="how many of the streams send long prompts")
    lo_.add_argument("--long-tokens", type=int, default=8192)
    lo_.add_argument("--long-max-tokens", type=int, default=16)
    lo_.add_argument("--short-tokens", type=int, default=128)
    lo_.add_argument("--decode-tokens", type=int, default=256)
    lo_.add_argument("--long-delay", type=float, default=2.0, help="seconds of decode before the long prompts")
    sc = sub.add_parser("scaling")
    sc.add_argument("--levels", default="1,8,32")
    sc.add_argument("--prompt-tokens", type=int, default=128)
    sc.add_argument("--decode-tokens", type=int, default=128)
    pr = sub.add_parser("prefix")
    pr.add_argument("--turns", type=int, default=10)
    pr.add_argument("--history-tokens", type=int, default=8192)
    pr.add_argument("--turn-tokens", type=int, default=64)
    pr.add_argument("--reply-tokens", type=int, default=32)
    a = p.parse_args()
    global LENIENT_USAGE
    LENIENT_USAGE = a.lenient_usage
    lo, hi = (int(x) for x in a.ids.split(":"))
    client = Client(a.url, a.model, a.timeout)
    # Each mode draws its own ids: a conversation's first turn must not share a prefix with an earlier mode's prompts.
    rng = random.Random(f"{a.seed}:{a.mode}")
    res, problems = {"load": mode_load, "scaling": mode_scaling, "prefix": mode_prefix}[a.mode](a, client, rng, lo, hi)
    res["problems"] = problems
    res["url"] = a.url
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    for q in problems[:20]:
        print(f"  PROBLEM {q}")
    if len(problems) > 20:
        print(f"  ... {len(problems) - 20} more problems")
    print(f"{a.mode}: {'ok' if not problems else f'{len(problems)} problems'}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
