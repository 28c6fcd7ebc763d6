"""addnorm-export: export an encoder to an ONNX artifact, gated by graph checks and parity."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from export import attention
from export.bert import BERT_DEFAULTS, bert_shape
from export.checks import GraphCheckError
from export.gate import ParityError
from export.onnx_export import DEFAULT_OPSET, MIN_OPSET, ExportError
from export.pipeline import export_artifact, prepare_encoder
from export.report import format_table
from export.variants import VARIANTS
from export.weights import CheckpointError, read_state_dict
from model.artifact import ArtifactError, load_verified
from model.config import ConfigError, EncoderConfig

# CLI flag -> EncoderConfig field. Flags override values from --config.
_CONFIG_FLAGS = {
    "d_model": int,
    "nhead": int,
    "dim_feedforward": int,
    "num_layers": int,
    "activation": str,
    "layer_norm_eps": float,
    "dropout": float,
    "norm": str,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="addnorm-export",
        description="Export a Transformer encoder block to ONNX (native LayerNormalization), check the graph, "
        "and gate it on numerical parity against PyTorch. Writes model.onnx, weights.safetensors and "
        "manifest.json into --out; on any failure it exits non-zero and writes no manifest.",
    )
    p.add_argument("--out", required=True, type=Path, help="artifact directory to write (created if missing)")
    p.add_argument("--config", type=Path, help="EncoderConfig JSON file; the flags below override its fields")
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="weights: .safetensors, or a torch state_dict (read with weights_only=True). Keys of "
        "torch.nn.TransformerEncoderLayer / TransformerEncoder load as they are",
    )
    p.add_argument(
        "--from-bert",
        type=Path,
        metavar="FILE",
        help="weights of Hugging Face BertLayer(s) (a BertLayer, BertEncoder or BertModel state_dict); "
        "implies gelu, eps 1e-12, post-norm unless those flags are given",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the deterministic default weights (default 0)"
    )
    v = p.add_argument_group(
        "variant (each gated by its own parity tolerance)",
        "; ".join(f"{name}: {var.summary}" for name, var in VARIANTS.items()),
    )
    v.add_argument("--variant", choices=list(VARIANTS), help="the graph variant (default fp32)")
    v.add_argument(
        "--precision",
        choices=[n for n, var in VARIANTS.items() if n == var.precision],
        help="shorthand for --variant fp32|fp16|int8",
    )
    v.add_argument("--optimize", choices=["none", "fused"], help="--optimize fused = --variant fused")
    v.add_argument(
        "--attention",
        choices=list(attention.CHOICES),
        default="auto",
        help=f"how attention is spelled: mha (onnxruntime's com.microsoft.MultiHeadAttention, one node per layer; "
        f"flash attention on CPU when nothing is padded), onnx (ONNX's Attention operator, opset >= "
        f"{attention.ONNX_ATTENTION_MIN_OPSET}), decomposed (MatMul/Softmax op by op: runs on any runtime); "
        f"default auto = {attention.AUTO}",
    )
    p.add_argument(
        "--opset",
        type=int,
        default=DEFAULT_OPSET,
        help=f"ONNX opset, >= {MIN_OPSET} (default {DEFAULT_OPSET})",
    )
    p.add_argument(
        "--name", default="encoder", help="model name in the manifest and the APIs (default encoder)"
    )
    g = p.add_argument_group(
        "model (defaults: 768 wide, 12 heads, ff 3072, 1 layer, post-norm, relu, eps 1e-5)"
    )
    g.add_argument("--d-model", type=int)
    g.add_argument("--nhead", type=int)
    g.add_argument("--dim-feedforward", type=int)
    g.add_argument("--num-layers", type=int)
    g.add_argument("--activation", choices=["relu", "gelu"])
    g.add_argument("--layer-norm-eps", type=float)
    g.add_argument("--dropout", type=float, help="kept in the config; inactive in the exported (eval) graph")
    g.add_argument(
        "--norm",
        choices=["layer", "rms"],
        help="LayerNorm (default) or RMSNorm (ONNX RMSNormalization, needs --opset 23)",
    )
    g.add_argument(
        "--norm-first",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pre-norm (x + f(LN(x))) instead of post-norm (LN(x + f(x)))",
    )
    g.add_argument(
        "--batch-first",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="embeddings as [batch, seq, d_model] (default) or [seq, batch, d_model] with --no-batch-first",
    )
    p.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when --out already holds a valid artifact (manifest and matching model.onnx)",
    )
    p.add_argument("--json", action="store_true", help="print the parity summary as JSON instead of a table")
    p.add_argument("-q", "--quiet", action="store_true", help="only errors")
    return p


def config_from_args(args: argparse.Namespace, detected: dict | None = None) -> EncoderConfig:
    """--config's file, then the flags; ``detected``: what a BERT checkpoint's weights say (layers, widths),
    under both."""
    fields = EncoderConfig.load(args.config).to_dict() if args.config else {}
    if args.from_bert:
        fields = {**BERT_DEFAULTS, **(detected or {}), **fields}
    for name in (*_CONFIG_FLAGS, "norm_first", "batch_first"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    return EncoderConfig.from_dict(fields)


def variant_from_args(args: argparse.Namespace) -> str:
    """--variant, or its shorthands --precision and --optimize; contradicting flags are an error."""
    fused = args.optimize == "fused"
    precision = None if fused and args.precision == "fp32" else args.precision  # fused is an fp32 graph
    chosen = {args.variant, precision, "fused" if fused else None} - {None}
    if len(chosen) > 1:
        raise ConfigError(
            f"--variant, --precision and --optimize name different variants {sorted(chosen)}; "
            "give one (--optimize fused applies to fp32 graphs)"
        )
    return chosen.pop() if chosen else "fp32"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("addnorm").setLevel(logging.ERROR if args.quiet else logging.INFO)
    if args.if_missing and _valid_artifact(args.out):
        if not args.quiet:
            print(f"{args.out} already holds a valid artifact; nothing to do (--if-missing)")
        return 0
    try:
        if args.checkpoint and args.from_bert:
            raise ConfigError("give either --checkpoint or --from-bert, not both")
        variant = variant_from_args(args)
        state, detected = None, None
        if args.from_bert:  # its layer count and widths come from the weights unless given
            state = read_state_dict(args.from_bert)
            detected = bert_shape(state)
        config = config_from_args(args, detected)
        encoder = prepare_encoder(
            config, args.checkpoint or args.from_bert, args.seed, bool(args.from_bert), state=state
        )
        result = export_artifact(
            encoder, args.out, name=args.name, opset=args.opset, variant=variant, attention=args.attention
        )
    except ParityError as exc:
        print(format_table(exc.report), file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError, ExportError, GraphCheckError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.report.summary(), indent=2))
    elif not args.quiet:
        print(format_table(result.report))
        print(f"wrote {result.out_dir}/ (model.onnx sha256 {result.manifest.model_sha256[:12]}...)")
    return 0


def _valid_artifact(out: Path) -> bool:
    try:
        load_verified(out)
    except ArtifactError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
