"""Random SPMD torch.distributed programs (gloo, CPU) with one injected bug and their ground truth.

    from benchmarks.randprog.generator import generate   # with the repository root on sys.path
    prog = generate(seed=1, index=3, bug="skip")        # deterministic per (seed, index, bug, world)
    prog.source        # a plain torch.distributed script, no ncclscope import
    prog.truth         # Truth: bug class, culprits, acceptable kinds, expected lines

A program: init_process_group("gloo", timeout=T); a mesh of 0-3 dimensions made with
init_device_mesh("cpu", ...) or new_group loops (in the order users write them); helper functions
that issue collectives (called from several loop lines, so a call site repeats); then a loop of a
random body: collectives of every kind, p2p rings / pipelines / pairwise exchanges, compute of
random length, an SGD or DDP training step; then post-loop ops and destroy_process_group.

Expected lines are found by marking source lines while generating (`Src.add(..., mark=...)`) and
reading the marks' line numbers off the finished text; the marks are not written into the script.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from .catalogue import BUG_NAMES, CATALOGUE, HEALTHY

# --------------------------------------------------------------------------------------------------
# ground truth
# --------------------------------------------------------------------------------------------------


@dataclass
class Truth:
    name: str
    seed: int
    index: int
    bug: str                          # a catalogue class or "healthy"
    world: int
    culprits: list[int]
    accept_roots: list[list[int]]     # each an acceptable set of headline root ranks (sorted)
    accept_kinds: list[str]
    lines: list[int]                  # acceptable expected user lines (first is primary); [] = not judged
    line_texts: list[str]             # the source text of each expected line (consistency checks)
    step: int | None                  # the loop iteration the bug fires at (None: every step / setup)
    detail: str
    mesh_shape: list[int]
    mesh_dims: list[str]
    mesh_mode: str                    # "none" | "device_mesh" | "new_group"
    steps: int
    pg_timeout_s: float
    dies: list[int] = field(default_factory=list)   # ranks whose process ends by itself (no FR dump)
    statements: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Program:
    source: str
    truth: Truth
    filename: str


# --------------------------------------------------------------------------------------------------
# source builder
# --------------------------------------------------------------------------------------------------


class Src:
    """Lines with optional marks; `render` returns the text and mark -> 1-based line numbers."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str | None]] = []

    def add(self, indent: int, text: str, mark: str | None = None) -> None:
        self.lines.append(("    " * indent + text if text else "", mark))

    def render(self) -> tuple[str, dict[str, int]]:
        marks: dict[str, int] = {}
        for i, (_, m) in enumerate(self.lines, 1):
            if m is not None:
                marks.setdefault(m, i)
        return "\n".join(t for t, _ in self.lines) + "\n", marks


# --------------------------------------------------------------------------------------------------
# vocabulary
# --------------------------------------------------------------------------------------------------

DIM_NAMES = ["dp", "tp", "pp", "cp", "ep", "sp", "fsdp", "shard", "rep", "inner", "outer", "row", "col"]
LOOP_VARS = ["step", "it", "i", "epoch", "k", "n_iter", "t", "batch_idx"]
RANK_VARS = ["rank", "my_rank", "rk", "global_rank"]
WORLD_VARS = ["world", "world_size", "ws", "nranks"]
TENSOR_NAMES = ["x", "buf", "grad", "act", "h", "stats", "feats", "chunk", "payload", "tokens", "msg", "acc",
                "z", "emb", "logits", "scores", "state", "delta", "mom", "probe"]
HELPER_NAMES = ["sync_grads", "gather_feats", "reduce_stats", "share", "avg_across", "collect", "fetch_all",
                "spread", "combine", "allreduce_", "merge_shards", "pull", "exchange_all", "replicate"]
COLL_KINDS = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
              "reduce", "all_to_all_single", "barrier", "bcast_obj", "gather_obj"]
HELPER_KINDS = ["all_reduce", "all_gather_into_tensor", "all_gather", "broadcast", "reduce_scatter_tensor"]
DTYPES = ["torch.float32", "torch.float32", "torch.float64", "torch.int64", "torch.bfloat16"]
WORLD_WEIGHTS = {2: 5, 3: 3, 4: 6, 5: 1.5, 6: 3, 7: 0.3, 8: 1.2, 9: 0.1, 10: 0.1, 12: 0.2, 16: 0.2}


def mesh_shapes(world: int) -> list[tuple[int, ...]]:
    """Every shape of 1-3 dimensions (each >= 2) whose product is `world`."""
    out: list[tuple[int, ...]] = [(world,)]
    for a in range(2, world):
        if world % a == 0:
            b = world // a
            out.append((a, b))
            for c in range(2, b):
                if b % c == 0 and b // c >= 2:
                    out.append((a, c, b // c))
    return out


def slices(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """The rank lists of dimension `dim` of a row-major mesh (what DeviceMesh builds)."""
    import itertools
    others = [range(s) for d, s in enumerate(shape) if d != dim]
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    groups = []
    for coord in itertools.product(*others):
        base = 0
        j = 0
        for d in range(len(shape)):
            if d == dim:
                continue
            base += coord[j] * strides[d]
            j += 1
        groups.append([base + i * strides[dim] for i in range(shape[dim])])
    return groups


# --------------------------------------------------------------------------------------------------
# the generator
# --------------------------------------------------------------------------------------------------


class Gen:
    def __init__(self, seed: int, index: int, bug: str, world: int | None, max_world: int) -> None:
        self.seed, self.index, self.bug = seed, index, bug
        self.rng = random.Random(f"randprog:{seed}:{index}:{bug}")
        r = self.rng
        need = CATALOGUE[bug].needs_world if bug != HEALTHY else 2
        if world is None:
            cands = [w for w in WORLD_WEIGHTS if need <= w <= max_world]
            if bug in ("wrong_group", "group_order"):
                cands = [w for w in cands if len(mesh_shapes(w)) > 1] or [4]
            world = r.choices(cands, weights=[WORLD_WEIGHTS[w] for w in cands])[0]
        self.W = world
        self.R = r.choice(RANK_VARS)
        self.WV = r.choice(WORLD_VARS)
        self.LV = r.choice(LOOP_VARS)
        self.steps = r.randint(3, 7) if bug != "slow" else r.randint(8, 12)
        self.bug_step = r.randint(1, self.steps - 1)
        self.used_names: set[str] = {self.R, self.WV, self.LV}
        # mesh
        shapes = mesh_shapes(world) if world >= 2 else [()]
        if bug in ("wrong_group", "group_order"):
            shapes = [s for s in shapes if len(s) >= 2]
        if bug == "wrong_group" or bug == "group_order" or r.random() < 0.75:
            self.shape: tuple[int, ...] = r.choice(shapes)
        else:
            self.shape = ()
        self.mode = "none" if not self.shape else (
            "new_group" if bug == "group_order" or r.random() < 0.45 else "device_mesh")
        dims = r.sample(DIM_NAMES, len(self.shape))
        self.dims = dims
        self.gvar = {d: f"{d}_group" for d in dims}
        self.pg_timeout = float(r.choice([5, 6, 8])) + (4.0 if world >= 6 else 0.0)
        self.helpers: dict[str, str] = {}          # kind -> helper name
        self.src = Src()
        self.notes: list[str] = []
        self.culprits: list[int] = []
        self.roots: list[list[int]] = []
        self.detail = ""
        self.line_marks: list[str] = []
        self.statements: list[dict[str, Any]] = []
        self.dies: list[int] = []

    # ---- names -----------------------------------------------------------------------------------
    def name(self, pool: list[str]) -> str:
        r = self.rng
        for _ in range(50):
            n = r.choice(pool)
            if n not in self.used_names:
                self.used_names.add(n)
                return n
        n = f"{r.choice(pool)}{len(self.used_names)}"
        self.used_names.add(n)
        return n

    def cond(self, rank: int, at_step: bool = True) -> str:
        """The bug's condition, in one of the ways users write it."""
        r = self.rng
        if not at_step:
            return r.choice([f"{self.R} == {rank}", f"dist.get_rank() == {rank}"])
        return r.choice([f"{self.R} == {rank} and {self.LV} == {self.bug_step}",
                         f"{self.LV} == {self.bug_step} and {self.R} == {rank}",
                         f"({self.R}, {self.LV}) == ({rank}, {self.bug_step})"])

    # ---- groups ----------------------------------------------------------------------------------
    def members(self, g: str, rank: int) -> list[int]:
        if g == "world":
            return list(range(self.W))
        d = self.dims.index(g)
        return next(s for s in slices(self.shape, d) if rank in s)

    def gsize(self, g: str) -> int:
        return self.W if g == "world" else self.shape[self.dims.index(g)]

    def gkw(self, g: str, explicit_world: bool = False) -> str:
        if g == "world":
            return ", group=dist.group.WORLD" if explicit_world else ""
        return f", group={self.gvar[g]}"

    def gexpr(self, g: str) -> str:
        return "None" if g == "world" else self.gvar[g]

    def size_expr(self, g: str) -> str:
        return self.WV if g == "world" else f"{g}_size"

    def me_expr(self, g: str) -> str:
        return self.R if g == "world" else f"{g}_rank"

    # ---- plan ------------------------------------------------------------------------------------
    def plan(self) -> None:
        r = self.rng
        bug = self.bug
        groups = ["world"] + self.dims
        body: list[dict[str, Any]] = []
        nhelp = r.choice([1, 1, 2]) if r.random() < 0.85 else 0
        for kind in r.sample(HELPER_KINDS, nhelp):
            self.helpers[kind] = self.name(HELPER_NAMES)
        n_stmt = r.randint(3, 6)
        for _ in range(n_stmt):
            roll = r.random()
            if roll < 0.5:
                kind = r.choice(COLL_KINDS)
                body.append(self.coll(kind, r.choice(groups)))
            elif roll < 0.65 and self.W >= 2:
                body.append(self.p2p(r.choice(["ring_async", "ring_batch", "pair", "chain"])))
            else:
                body.append({"t": "compute", "n": r.randint(1, 25), "d": r.choice([8, 16, 32, 64])})
        for kind, _h in self.helpers.items():        # every helper is called from >= 2 loop lines
            for _ in range(2):
                st = self.coll(kind, r.choice(groups))
                st["helper"] = True
                body.insert(r.randint(0, len(body)), st)
        if r.random() < 0.45 or bug == "nan":
            body.insert(r.randint(0, len(body)), {"t": "train", "ddp": r.random() < 0.5, "g": r.choice(groups),
                                                  "d": r.choice([8, 16, 24, 32]), "b": r.choice([2, 4, 8])})
        if not any(s["t"] == "compute" for s in body):
            body.insert(r.randint(0, len(body)), {"t": "compute", "n": r.randint(1, 10), "d": 16})
        self.body = body
        self.post = r.sample(["final_reduce", "barrier", "none", "none"], 1)[0]
        self.sharded = bug == "uneven_loop" or r.random() < 0.3
        self.main_fn = r.random() < 0.5

    def coll(self, kind: str, g: str) -> dict[str, Any]:
        r = self.rng
        if kind in ("bcast_obj", "gather_obj", "barrier"):
            n = 0
        else:
            n = r.choice([1, 3, 8, 16, 64, 100, 256, 1000, 1024, 4096])
        dt = "torch.float32" if kind in ("all_to_all_single",) else r.choice(DTYPES)
        if kind in ("reduce", "all_reduce", "reduce_scatter_tensor") and dt == "torch.bfloat16":
            dt = "torch.float32"
        return {"t": "coll", "kind": kind, "g": g, "n": n, "dtype": dt, "var": self.name(TENSOR_NAMES),
                "root": r.randrange(self.gsize(g)), "op": r.choice(["SUM", "SUM", "MAX", "MIN"]),
                "helper": False, "c": r.randrange(3)}

    def p2p(self, pattern: str) -> dict[str, Any]:
        r = self.rng
        g = "world"
        if pattern == "chain" and self.dims and r.random() < 0.5:
            g = r.choice(self.dims)
        return {"t": "p2p", "pattern": pattern, "g": g, "n": r.choice([4, 16, 128, 512]),
                "var": self.name(TENSOR_NAMES)}

    # ---- bug placement ---------------------------------------------------------------------------
    def place_bug(self) -> None:
        """Choose the statement the bug goes into and its culprit; record the culprit and roots."""
        r, bug, W = self.rng, self.bug, self.W
        self.target: dict[str, Any] | None = None
        if bug == HEALTHY:
            return
        colls = [s for s in self.body if s["t"] == "coll"]

        def need_coll(pred, make):
            cands = [s for s in colls if pred(s)]
            if not cands:
                s = make()
                self.body.insert(r.randint(0, len(self.body)), s)
                cands = [s]
            return r.choice(cands)

        culprit = r.randrange(W)
        if bug in ("skip", "extra"):
            self.target = need_coll(lambda s: True, lambda: self.coll("all_reduce", r.choice(["world"] + self.dims)))
        elif bug in ("size", "dtype"):
            ok = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                  "reduce") + (("all_to_all_single",) if bug == "size" else ())
            self.target = need_coll(lambda s: s["kind"] in ok and self.gsize(s["g"]) >= 2,
                                    lambda: self.coll(r.choice(ok[:4]), "world"))
            if bug == "dtype":
                self.target["bug_dtype"] = r.choice([d for d in ("torch.float64", "torch.float16")
                                                     if d != self.target["dtype"]])
                if self.target["dtype"] == "torch.int64":
                    self.target["bug_dtype"] = "torch.int32"
            else:
                self.target["bug_n"] = self.target["n"] + r.choice([1, 2, 7, 64])
        elif bug == "op_type":
            self.target = need_coll(lambda s: s["kind"] in ("all_reduce", "all_gather_into_tensor", "broadcast",
                                                             "reduce_scatter_tensor"),
                                    lambda: self.coll("all_reduce", r.choice(["world"] + self.dims)))
        elif bug == "wrong_group":
            t = self.coll("all_reduce", r.choice(self.dims))
            self.body.insert(r.randint(0, len(self.body)), t)
            self.target = t
            mine = self.members(t["g"], culprit)
            alts = [g for g in ["world"] + self.dims if g != t["g"] and self.members(g, culprit) != mine]
            if self.mode == "new_group":
                alts.append("slice")
            t["wrong"] = r.choice(alts)
        elif bug == "short_objlist":
            self.target = need_coll(lambda s: s["kind"] == "bcast_obj" and self.gsize(s["g"]) >= 2,
                                    lambda: self.coll("bcast_obj", r.choice(["world"] + self.dims)))
            t = self.target
            # the culprit is a receiver: not the group's source
            cands = [x for x in range(W) if self.members(t["g"], x)[t["root"]] != x]
            culprit = r.choice(cands)
        elif bug == "wrong_peer":
            cands = [s for s in self.body if s["t"] == "p2p" and s["pattern"] in ("ring_async", "ring_batch")]
            if not cands:
                s = self.p2p(r.choice(["ring_async", "ring_batch"]))
                self.body.insert(r.randint(0, len(self.body)), s)
                cands = [s]
            self.target = r.choice(cands)
            self.target["wrong_shift"] = r.randint(2, W - 1) if W > 2 else 1
        elif bug == "swap_order":
            cands = [s for s in self.body if s["t"] == "p2p" and s["pattern"] == "pair"]
            if not cands:
                s = self.p2p("pair")
                self.body.insert(r.randint(0, len(self.body)), s)
                cands = [s]
            self.target = r.choice(cands)
            culprit = r.randrange(W - (W % 2))       # a rank with a partner
            self.roots = [[culprit], sorted([culprit, culprit ^ 1])]
        elif bug in ("exception", "exit", "hang_compute", "slow"):
            self.target = r.choice([s for s in self.body if s["t"] == "compute"])
        elif bug == "nan":
            self.target = next(s for s in self.body if s["t"] == "train")
        elif bug == "uneven_loop":
            self.offset = r.randrange(W)
            culprit = (W - 1 - self.offset) % W
        elif bug == "group_order":
            pass
        if self.target is not None:
            self.target["bug"] = bug
        self.culprits = [culprit]
        if not self.roots:
            self.roots = [[culprit]]
        if CATALOGUE[bug].kills_culprit:
            self.dies = [culprit]

    # ---- emission --------------------------------------------------------------------------------
    def emit(self) -> None:
        s, r = self.src, self.rng
        W, R, WV, LV = self.W, self.R, self.WV, self.LV
        s.add(0, f'"""Generated SPMD program (randprog seed {self.seed}, #{self.index}): '
                 f'{len(self.shape)}-d mesh {list(self.shape)}, {self.steps} steps."""')
        imports = ["import datetime", "import os", "import time", "", "import torch",
                   r.choice(["import torch.distributed as dist", "from torch import distributed as dist"])]
        for line in imports:
            s.add(0, line)
        if self.mode == "device_mesh":
            s.add(0, "from torch.distributed.device_mesh import init_device_mesh")
        if any(st["t"] == "train" and st["ddp"] for st in self.body):
            s.add(0, "from torch.nn.parallel import DistributedDataParallel as DDP")
        s.add(0, "")
        s.add(0, "torch.set_num_threads(1)")
        s.add(0, "")
        self.emit_helpers()
        ind = 0
        if self.main_fn:
            s.add(0, "")
            s.add(0, "def main():")
            ind = 1
        s.add(ind, f'dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={self.pg_timeout:g}))')
        s.add(ind, f"{R} = dist.get_rank()")
        s.add(ind, f"{WV} = dist.get_world_size()")
        s.add(ind, f"torch.manual_seed(1234 + {R})")
        self.emit_mesh(ind)
        for st in self.body:
            if st["t"] == "train":
                self.emit_train_setup(ind, st)
            if st["t"] == "p2p" and st["pattern"] == "chain":
                mem = "list(range(%s))" % WV if st["g"] == "world" else f"dist.get_process_group_ranks({self.gvar[st['g']]})"
                st["stages"] = self.name(["stages", "pipe_ranks", "chain", "order", "line_up"])
                s.add(ind, f"{st['stages']} = {mem}")
        # the loop
        if self.sharded:
            bs = r.choice([1, 2, 4])
            total = W * bs * self.steps - (1 if self.bug == "uneven_loop" else 0)
            off = getattr(self, "offset", r.randrange(W))
            s.add(ind, f"samples = list(range(({R} + {off}) % {WV}, {total}, {WV}))  # this rank's shard")
            s.add(ind, f"batches = [samples[j:j + {bs}] for j in range(0, len(samples) - {bs} + 1, {bs})]")
            s.add(ind, f"for {LV}, batch_ids in enumerate(batches):", mark="loop")
        else:
            s.add(ind, f"for {LV} in range({self.steps}):", mark="loop")
        for st in self.body:
            self.emit_stmt(ind + 1, st)
        # after the loop
        if self.post == "final_reduce":
            s.add(ind, f"done = torch.tensor([float({LV})])")
            s.add(ind, "dist.all_reduce(done)", mark="post")
        elif self.post == "barrier":
            s.add(ind, "dist.barrier()", mark="post")
        s.add(ind, "dist.destroy_process_group()")
        if self.main_fn:
            s.add(0, "")
            s.add(0, "")
            s.add(0, 'if __name__ == "__main__":')
            s.add(1, "main()")

    def emit_helpers(self) -> None:
        s = self.src
        for kind, h in self.helpers.items():
            s.add(0, "")
            s.add(0, f"def {h}(t, group=None):")
            if kind == "all_reduce":
                s.add(1, "dist.all_reduce(t, group=group)", mark=f"h:{h}")
                s.add(1, "return t")
            elif kind == "all_gather_into_tensor":
                s.add(1, "out = torch.empty(dist.get_world_size(group) * t.numel(), dtype=t.dtype)")
                s.add(1, "dist.all_gather_into_tensor(out, t, group=group)", mark=f"h:{h}")
                s.add(1, "return out")
            elif kind == "all_gather":
                s.add(1, "parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]")
                s.add(1, "dist.all_gather(parts, t, group=group)", mark=f"h:{h}")
                s.add(1, "return torch.cat(parts)")
            elif kind == "broadcast":
                s.add(1, "src = 0 if group is None else dist.get_global_rank(group, 0)")
                s.add(1, "dist.broadcast(t, src=src, group=group)", mark=f"h:{h}")
                s.add(1, "return t")
            elif kind == "reduce_scatter_tensor":
                s.add(1, "out = torch.empty(t.numel() // dist.get_world_size(group), dtype=t.dtype)")
                s.add(1, "dist.reduce_scatter_tensor(out, t, group=group)", mark=f"h:{h}")
                s.add(1, "return out")
        s.add(0, "")

    def emit_mesh(self, ind: int) -> None:
        s, r = self.src, self.rng
        if self.mode == "none":
            return
        shape = ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "")
        if self.mode == "device_mesh":
            names = ", ".join(f'"{d}"' for d in self.dims) + ("," if len(self.dims) == 1 else "")
            s.add(ind, f'mesh = init_device_mesh("cpu", ({shape}), mesh_dim_names=({names}))')
            for d in self.dims:
                s.add(ind, f'{self.gvar[d]} = mesh.get_group("{d}")')
        else:
            sl = {d: slices(self.shape, i) for i, d in enumerate(self.dims)}
            s.add(ind, "layout = {")
            for d in self.dims:
                s.add(ind + 1, f'"{d}": {sl[d]},')
            s.add(ind, "}")
            s.add(ind, "groups, all_groups = {}, {}")
            s.add(ind, f"dim_order = {self.dims!r}")
            if self.bug == "group_order":
                c = self.culprits[0]
                s.add(ind, f"if {self.cond(c, at_step=False)}:", mark="order_if")
                s.add(ind + 1, "dim_order = dim_order[::-1]  # built in another order here", mark="order")
            s.add(ind, "for dim in dim_order:")
            s.add(ind + 1, "for members in layout[dim]:")
            s.add(ind + 2, "g = dist.new_group(members)", mark="new_group")
            s.add(ind + 2, "all_groups[(dim, tuple(members))] = g")
            s.add(ind + 2, f"if {self.R} in members:")
            s.add(ind + 3, "groups[dim] = g")
            for d in self.dims:
                s.add(ind, f'{self.gvar[d]} = groups["{d}"]')
        for d in self.dims:
            s.add(ind, f"{d}_size = dist.get_world_size({self.gvar[d]})")
            s.add(ind, f"{d}_rank = dist.get_rank({self.gvar[d]})")

    def emit_train_setup(self, ind: int, st: dict[str, Any]) -> None:
        s, r = self.src, self.rng
        d = st["d"]
        st["model"] = self.name(["net", "model", "mlp", "layer", "head", "block"])
        st["opt"] = self.name(["opt", "optimizer", "sgd"])
        st["loss"] = self.name(["loss", "objective", "l"])
        st["batch"] = self.name(["batch", "inputs", "xb", "sample"])
        hidden = r.choice([8, 16, 32])
        s.add(ind, f"{st['model']} = torch.nn.Sequential(torch.nn.Linear({d}, {hidden}), torch.nn.Tanh(), "
                   f"torch.nn.Linear({hidden}, 1))")
        if st["ddp"]:
            pg = "" if st["g"] == "world" else f", process_group={self.gvar[st['g']]}"
            s.add(ind, f"{st['model']} = DDP({st['model']}{pg})")
        s.add(ind, f"{st['opt']} = torch.optim.SGD({st['model']}.parameters(), lr=0.01)")

    def emit_stmt(self, ind: int, st: dict[str, Any]) -> None:
        t = st["t"]
        if t == "coll":
            self.emit_coll(ind, st)
        elif t == "p2p":
            self.emit_p2p(ind, st)
        elif t == "compute":
            self.emit_compute(ind, st)
        elif t == "train":
            self.emit_train(ind, st)

    # ---- statements --------------------------------------------------------------------------------
    def emit_compute(self, ind: int, st: dict[str, Any]) -> None:
        s, r = self.src, self.rng
        v = st.setdefault("var", self.name(TENSOR_NAMES))
        w = st.setdefault("w", self.name(["w", "weight", "proj", "kernel", "mat"]))
        d = st["d"]
        bug = st.get("bug")
        c = self.culprits[0] if self.culprits else -1
        s.add(ind, f"{w} = torch.randn({d}, {d}) / {d}")
        s.add(ind, f"{v} = torch.randn({r.choice([1, 4, 8])}, {d})")
        s.add(ind, f"for _ in range({st['n']}):")
        s.add(ind + 1, f"{v} = torch.tanh({v} @ {w})")
        if bug == "exception":
            exc = r.choice(["RuntimeError", "ValueError", "KeyError", "AssertionError"])
            s.add(ind, f"if {self.cond(c)}:")
            s.add(ind + 1, f'raise {exc}(f"corrupt sample in batch {{{self.LV}}}")', mark="bug")
            self.detail = f"rank {c} raises {exc} at step {self.bug_step}"
        elif bug == "exit":
            code = r.choice([1, 2, 3, 137])
            s.add(ind, f"if {self.cond(c)}:")
            s.add(ind + 1, f"os._exit({code})", mark="bug")
            self.detail = f"rank {c} calls os._exit({code}) at step {self.bug_step}"
        elif bug == "hang_compute":
            s.add(ind, f"if {self.cond(c)}:")
            s.add(ind + 1, "time.sleep(600)  # waits for data that never comes", mark="bug")
            self.detail = f"rank {c} sleeps 600 s in compute at step {self.bug_step}"
        elif bug == "slow":
            ms = r.choice([50, 80, 150])
            s.add(ind, f"if {self.cond(c, at_step=False)}:")
            s.add(ind + 1, f"time.sleep({ms / 1000:g})", mark="bug")
            self.detail = f"rank {c} sleeps {ms} ms every step (slow, no hang)"

    def emit_train(self, ind: int, st: dict[str, Any]) -> None:
        s, r = self.src, self.rng
        m, o, lo, b = st["model"], st["opt"], st["loss"], st["batch"]
        s.add(ind, f"{b} = torch.randn({st['b']}, {st['d']})")
        if st.get("bug") == "nan":
            c = self.culprits[0]
            s.add(ind, f"if {self.cond(c)}:")
            s.add(ind + 1, f'{b}[0, {r.randrange(st["d"])}] = float("nan")  # a corrupt sample', mark="bug")
            self.detail = f"rank {c}'s batch has a NaN at step {self.bug_step}"
        s.add(ind, f"{lo} = {m}({b}).pow(2).mean()")
        s.add(ind, f"{lo}.backward()", mark="backward")
        if not st["ddp"]:
            gk = self.gkw(st["g"])
            s.add(ind, f"for p in {m}.parameters():")
            s.add(ind + 1, f"dist.all_reduce(p.grad{gk})", mark="grad_ar")
            s.add(ind + 1, f"p.grad /= {self.size_expr(st['g'])}")
        s.add(ind, f"{o}.step()")
        s.add(ind, f"{o}.zero_grad()")

    def emit_p2p(self, ind: int, st: dict[str, Any]) -> None:
        s, r = self.src, self.rng
        v, n, R, WV = st["var"], st["n"], self.R, self.WV
        bug = st.get("bug")
        c = self.culprits[0] if self.culprits else -1
        recv = f"{v}_in"

        def mk(m: str) -> str | None:
            return m if bug else None

        s.add(ind, f"{v} = torch.full(({n},), float({R}))")
        s.add(ind, f"{recv} = torch.empty({n})")
        pat = st["pattern"]
        if pat in ("ring_async", "ring_batch"):
            nxt = f"({R} + 1) % {WV}"
            if bug == "wrong_peer":
                k = st["wrong_shift"]
                s.add(ind, f"dst = ({R} + {k}) % {WV} if {self.cond(c)} else {nxt}", mark="bug_dst")
                nxt = "dst"
                self.detail = f"rank {c} sends to rank {(c + k) % self.W} instead of {(c + 1) % self.W} at step {self.bug_step}"
            prv = f"({R} - 1) % {WV}"
            if pat == "ring_async":
                s.add(ind, f"reqs = [dist.isend({v}, {nxt}), dist.irecv({recv}, {prv})]", mark=mk("p2p"))
                s.add(ind, "for req in reqs:")
                s.add(ind + 1, "req.wait()", mark=mk("p2p_wait"))
            else:
                s.add(ind, f"ops = [dist.P2POp(dist.isend, {v}, {nxt}), dist.P2POp(dist.irecv, {recv}, {prv})]")
                s.add(ind, "for req in dist.batch_isend_irecv(ops):", mark=mk("p2p"))
                s.add(ind + 1, "req.wait()", mark=mk("p2p_wait"))
        elif pat == "pair":
            s.add(ind, f"peer = {R} ^ 1")
            s.add(ind, f"if peer < {WV}:")
            s.add(ind + 1, f"send_first = {R} % 2 == 0")
            if bug == "swap_order":
                s.add(ind + 1, f"if {self.cond(c)}:")
                s.add(ind + 2, "send_first = not send_first  # reordered", mark="bug_flip")
                self.detail = (f"rank {c} swaps its send/recv order with rank {c ^ 1} at step {self.bug_step} "
                               "(both block in the same direction)")
            s.add(ind + 1, "if send_first:")
            s.add(ind + 2, f"dist.send({v}, peer)", mark=mk("pair_send_first"))
            s.add(ind + 2, f"dist.recv({recv}, peer)")
            s.add(ind + 1, "else:")
            s.add(ind + 2, f"dist.recv({recv}, peer)", mark=mk("pair_recv_first"))
            s.add(ind + 2, f"dist.send({v}, peer)")
            if bug == "swap_order":
                # even culprit now receives first (blocks at the else-branch recv, as its partner does);
                # odd culprit now sends first (blocks at the if-branch send, as its partner does)
                self.line_marks = ["pair_recv_first" if c % 2 == 0 else "pair_send_first", "bug_flip"]
        elif pat == "chain":
            stg = st["stages"]
            s.add(ind, f"pos = {stg}.index({R})")
            s.add(ind, "if pos > 0:")
            s.add(ind + 2 - 1, f"dist.recv({v}, {stg}[pos - 1])", mark=mk("chain_recv"))
            s.add(ind, f"{v} = {v} * 0.5 + 1.0")
            s.add(ind, f"if pos < len({stg}) - 1:")
            s.add(ind + 1, f"dist.send({v}, {stg}[pos + 1])", mark=mk("chain_send"))

    def emit_coll(self, ind: int, st: dict[str, Any]) -> None:
        s, r = self.src, self.rng
        bug = st.get("bug")
        c = self.culprits[0] if self.culprits else -1
        g, v, kind = st["g"], st["var"], st["kind"]
        cond = self.cond(c) if bug else ""
        N = str(st["n"])
        D = st["dtype"]
        if bug == "size" and kind != "all_to_all_single":
            N = f"({st['bug_n']} if {cond} else {st['n']})"
            self.detail = f"rank {c} passes {st['bug_n']} elements instead of {st['n']} to {kind} at step {self.bug_step}"
        if bug == "dtype":
            D = f"({st['bug_dtype']} if {cond} else {st['dtype']})"
            self.detail = f"rank {c} passes {st['bug_dtype']} instead of {st['dtype']} to {kind} at step {self.bug_step}"
        GS, ME = self.size_expr(g), self.me_expr(g)
        gk = self.gkw(g, explicit_world=r.random() < 0.3)
        gx = self.gexpr(g)
        if bug == "wrong_group":
            wrong = st["wrong"]
            if wrong == "slice":
                mine = self.members(g, c)
                other = next(sl for sl in slices(self.shape, self.dims.index(g)) if sl != mine)
                wexpr = f'all_groups[("{g}", {tuple(other)!r})]'
                desc = f"the {g} slice {other} it is not a member of"
            else:
                wexpr = self.gexpr(wrong) if wrong != "world" else "dist.group.WORLD"
                desc = f"the {wrong} group"
            s.add(ind, f"grp = {wexpr} if {cond} else {self.gvar[g]}")
            gk, gx = ", group=grp", "grp"
            self.detail = f"rank {c} all-reduces on {desc} instead of its {g} group at step {self.bug_step}"
        helper = self.helpers.get(kind) if st["helper"] else None
        if bug == "skip":
            s.add(ind, f"if not ({cond}):")
            ind += 1
            self.detail = f"rank {c} skips {kind} on {g} at step {self.bug_step}"
        if bug == "extra":
            lg = r.choice(["world"] + self.dims)
            s.add(ind, f"if {cond}:")
            s.add(ind + 1, f"dist.all_reduce(torch.tensor([float({self.LV})]){self.gkw(lg)})  # log progress",
                  mark="bug")
            self.detail = f"rank {c} alone all-reduces a scalar on {lg} at step {self.bug_step}"
        alt_open = False
        if bug == "op_type":
            s.add(ind, f"if {cond}:")
            if kind == "broadcast":
                s.add(ind + 1, f"dist.all_reduce(torch.zeros({st['n']}, dtype={D}){gk})", mark="bug")
                alt = "all_reduce"
            else:
                src = "0" if g == "world" else f"dist.get_global_rank({gx}, 0)"
                s.add(ind + 1, f"dist.broadcast(torch.zeros({st['n']}, dtype={D}), src={src}{gk})", mark="bug")
                alt = "broadcast"
            s.add(ind, "else:")
            ind += 1
            alt_open = True
            self.detail = f"rank {c} issues {alt} where its peers issue {kind} at step {self.bug_step}"
        mark = "call"
        if helper:
            if kind == "reduce_scatter_tensor":
                s.add(ind, f"{v} = torch.ones({GS} * {N}, dtype={D})")
            elif kind == "all_reduce" and D != "torch.float32":
                s.add(ind, f"{v} = torch.ones({N}, dtype={D}) * ({self.R} + 1)")
            else:
                s.add(ind, f"{v} = torch.full(({N},), {self.R} + 1.0, dtype={D})" if "int" not in D else
                      f"{v} = torch.full(({N},), {self.R} + 1, dtype={D})")
            s.add(ind, f"{v} = {helper}({v}, {gx})" if r.random() < 0.7 else f"{v} = {helper}({v}, group={gx})",
                  mark=mark)
        elif kind == "all_reduce":
            s.add(ind, f"{v} = torch.ones({N}, dtype={D}) * ({self.R} + 1)")
            op = st["op"]
            opk = f", op=dist.ReduceOp.{op}" if op != "SUM" or r.random() < 0.3 else ""
            s.add(ind, f"dist.all_reduce({v}{opk}{gk})", mark=mark)
        elif kind == "all_gather":
            s.add(ind, f"{v} = torch.arange({N}, dtype={D}) + {self.R}")
            s.add(ind, f"{v}_parts = [torch.empty_like({v}) for _ in range({GS})]")
            s.add(ind, f"dist.all_gather({v}_parts, {v}{gk})", mark=mark)
        elif kind == "all_gather_into_tensor":
            s.add(ind, f"{v} = torch.ones({N}, dtype={D}) * {self.R}")
            s.add(ind, f"{v}_all = torch.empty({GS} * {v}.numel(), dtype={v}.dtype)")
            s.add(ind, f"dist.all_gather_into_tensor({v}_all, {v}{gk})", mark=mark)
        elif kind == "reduce_scatter_tensor":
            s.add(ind, f"{v} = torch.empty({N}, dtype={D})")
            s.add(ind, f"{v}_in = torch.ones({GS} * {v}.numel(), dtype={v}.dtype)")
            s.add(ind, f"dist.reduce_scatter_tensor({v}, {v}_in{gk})", mark=mark)
        elif kind in ("broadcast", "reduce"):
            src = str(st["root"]) if g == "world" else f"dist.get_global_rank({gx}, {st['root']})"
            s.add(ind, f"{v} = torch.ones({N}, dtype={D}) * {self.R}")
            key = "src" if kind == "broadcast" else "dst"
            s.add(ind, f"dist.{kind}({v}, {key}={src}{gk})", mark=mark)
        elif kind == "all_to_all_single":
            cc = st["c"]
            s.add(ind, f"in_splits = [1 + ({ME} + 2 * j + {cc}) % 3 for j in range({GS})]")
            s.add(ind, f"out_splits = [1 + (j + 2 * {ME} + {cc}) % 3 for j in range({GS})]")
            if bug == "size":
                s.add(ind, f"if {cond}:")
                s.add(ind + 1, "in_splits[0] += 1")
                s.add(ind + 1, "in_splits[-1] -= 1  # same total, other split")
                self.detail = f"rank {c} passes other input split sizes (same total) to all_to_all_single at step {self.bug_step}"
            s.add(ind, f"{v} = torch.randn(sum(in_splits), {max(1, st['n'] // 64)}, dtype={D})")
            s.add(ind, f"{v}_out = torch.empty(sum(out_splits), {v}.shape[1], dtype={D})")
            s.add(ind, f"dist.all_to_all_single({v}_out, {v}, output_split_sizes=out_splits, "
                       f"input_split_sizes=in_splits{gk})", mark=mark)
        elif kind == "barrier":
            s.add(ind, f"dist.barrier({gk[2:]})", mark=mark)
        elif kind == "bcast_obj":
            src = str(st["root"]) if g == "world" else f"dist.get_global_rank({gx}, {st['root']})"
            s.add(ind, f"src = {src}")
            k = 2
            length = str(k)
            if bug == "short_objlist":
                length = f"({k - 1} if {self.cond(c)} else {k})"
                self.detail = f"rank {c} passes a {k - 1}-element object list instead of {k} to broadcast_object_list at step {self.bug_step}"
            s.add(ind, f'{v} = [{{"lr": 0.1 / ({self.LV} + 1), "tag": "cfg"}}, {self.LV}] if {self.R} == src '
                       f"else [None] * {length}")
            s.add(ind, f"dist.broadcast_object_list({v}, src=src{gk})", mark=mark)
        elif kind == "gather_obj":
            s.add(ind, f"{v} = [None] * {GS}")
            s.add(ind, f'dist.all_gather_object({v}, {{"rank": {self.R}, "step": {self.LV}}}{gk})', mark=mark)
        if bug and bug not in ("extra", "op_type"):
            self.line_marks = ["call"]
        elif bug == "extra":
            self.line_marks = ["bug"]
        elif bug == "op_type":
            self.line_marks = ["bug", "call"]
        # rename the marks of this statement so other statements' marks do not collide
        if bug:
            for i, (text, m) in enumerate(self.src.lines):
                if m in ("call", "bug"):
                    self.src.lines[i] = (text, "T" + m)
            self.line_marks = ["T" + m for m in self.line_marks]
        else:
            for i, (text, m) in enumerate(self.src.lines):
                if m == "call":
                    self.src.lines[i] = (text, None)
        del alt_open

    # ---- ground truth ------------------------------------------------------------------------------
    def finish(self) -> Program:
        text, marks = self.src.render()
        bug = self.bug
        if bug in ("exception", "exit", "hang_compute", "slow", "nan"):
            self.line_marks = ["bug"]
        elif bug == "uneven_loop":
            self.line_marks = ["loop"]
            c = self.culprits[0]
            self.detail = f"rank {c}'s data shard is one batch short: it leaves the loop after {self.steps - 1} steps"
        elif bug == "group_order":
            self.line_marks = ["new_group", "order"]
            self.detail = f"rank {self.culprits[0]} creates the mesh groups in the order {self.dims[::-1]}"
        elif bug == "wrong_peer":
            self.line_marks = ["p2p", "bug_dst"]
        if bug in ("slow", "nan"):
            self.line_marks = ["bug"]
        lines = [marks[m] for m in self.line_marks if m in marks]
        src_lines = text.split("\n")
        cls = CATALOGUE.get(bug)
        name = f"rp{self.seed}_{self.index:03d}_{bug}"
        truth = Truth(
            name=name, seed=self.seed, index=self.index, bug=bug, world=self.W,
            culprits=self.culprits, accept_roots=[sorted(x) for x in self.roots],
            accept_kinds=list(cls.kinds) if cls else [],
            lines=lines if (cls is None or cls.line_judged) else [],
            line_texts=[src_lines[n - 1].strip() for n in lines] if (cls is None or cls.line_judged) else [],
            step=self.bug_step if bug not in (HEALTHY, "slow", "group_order", "uneven_loop") else None,
            detail=self.detail or ("no bug" if bug == HEALTHY else bug),
            mesh_shape=list(self.shape), mesh_dims=list(self.dims), mesh_mode=self.mode, steps=self.steps,
            pg_timeout_s=self.pg_timeout, dies=self.dies,
            statements=[describe(st) for st in self.body])
        if bug == HEALTHY:
            truth.lines, truth.line_texts = [], []
        return Program(source=text, truth=truth, filename=name + ".py")


def describe(st: dict[str, Any]) -> str:
    t = st["t"]
    if t == "coll":
        return f"{st['kind']}@{st['g']}" + ("(helper)" if st["helper"] else "") + (f"[bug:{st['bug']}]" if st.get("bug") else "")
    if t == "p2p":
        return f"p2p:{st['pattern']}@{st['g']}" + (f"[bug:{st['bug']}]" if st.get("bug") else "")
    if t == "train":
        return ("ddp" if st["ddp"] else "sgd") + f"@{st['g']}" + (f"[bug:{st['bug']}]" if st.get("bug") else "")
    return f"compute x{st['n']}" + (f"[bug:{st['bug']}]" if st.get("bug") else "")


def generate(seed: int, index: int, bug: str = HEALTHY, world: int | None = None, max_world: int = 8) -> Program:
    """The `index`-th program of `seed` with bug class `bug` ("healthy" for none). Deterministic."""
    if bug != HEALTHY and bug not in BUG_NAMES:
        raise ValueError(f"unknown bug class {bug!r} (one of {', '.join(BUG_NAMES)}, {HEALTHY})")
    g = Gen(seed, index, bug, world, max_world)
    g.plan()
    g.place_bug()
    g.emit()
    return g.finish()
