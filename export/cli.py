"""addnorm-export: export an encoder to an ONNX artifact, gated by graph checks and parity."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import sys
from pathlib import Path

from addnorm.commands import Parser, add_artifact, add_output, quiet_dependencies
from addnorm.export import attention, families, hf, hub, model_dir, sentences
from addnorm.export.calibration import calibration_cases, load_arrays, sentences_of
from addnorm.export.checks import GraphCheckError
from addnorm.export.embedding import embed_sentences, text_export
from addnorm.export.families.bert import FAMILY as BERT
from addnorm.export.gate import ParityError
from addnorm.export.onnx_export import DEFAULT_OPSET, MIN_OPSET, ExportError
from addnorm.export.pipeline import export_artifact, prepare_encoder
from addnorm.export.report import format_table
from addnorm.export.variants import VARIANTS
from addnorm.export.weights import CheckpointError
from addnorm.model.artifact import ArtifactError, load_verified
from addnorm.model.config import FEED_FORWARDS, HEAD_ACTIVATIONS, HEADS, POOLINGS, ConfigError, EncoderConfig
from addnorm.model.text import IDS, INPUTS, TOKENIZER_FILE

log = logging.getLogger("addnorm.export")

# A bare BERT weights file (no config.json beside it): BertLayer's own settings
BERT_DEFAULTS = {"activation": "gelu", "layer_norm_eps": 1e-12, "norm_first": False}

# CLI flag -> EncoderConfig field. Flags override values from --config.
_CONFIG_FLAGS = {
    "d_model": int,
    "nhead": int,
    "dim_feedforward": int,
    "feed_forward": str,
    "head": str,
    "num_labels": int,
    "head_activation": str,
    "vocab_size": int,
    "num_layers": int,
    "activation": str,
    "layer_norm_eps": float,
    "dropout": float,
    "norm": str,
}
HEAD_FIELDS = ("head", "num_labels", "head_activation", "vocab_size")
_SWITCHES = ("norm_first", "batch_first", "pooling", "normalize_pooled", "packed")  # the flags without a type


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="addnorm-export",
        renamed={"--seed": "--weights-seed"},
        description="Export a Transformer encoder block to ONNX (native LayerNormalization), check the graph, "
        "and gate it on numerical parity against PyTorch. Writes model.onnx, weights.safetensors and "
        "manifest.json into --artifact; on any failure it exits non-zero and writes no manifest.",
    )
    add_artifact(p, "artifact directory to write (created if missing)")
    p.add_argument("--config", type=Path, help="EncoderConfig JSON file; the flags below override its fields")
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="weights: .safetensors, or a torch state_dict (read with weights_only=True). Keys of "
        "torch.nn.TransformerEncoderLayer / TransformerEncoder load as they are",
    )
    p.add_argument(
        "--from",
        "--from-bert",
        dest="from_bert",
        type=Path,
        metavar="DIR|FILE|ORG/NAME[@REV]",
        help="a Hugging Face model directory (config.json + model.safetensors, and its tokenizer.json) of a "
        f"supported encoder family (config.json's model_type: {', '.join(families.supported())}), or a "
        "weights file of BertLayer(s). The head count, widths, layer count, eps and activation come from "
        "config.json (a file's directory is read for one too); a flag that contradicts it is an error. Without "
        "config.json: BERT, gelu, eps 1e-12, post-norm unless flags say otherwise. Or a model id, ORG/NAME[@REVISION], "
        "fetched through huggingface_hub's cache (HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN); the manifest "
        "records its repository, commit and each file's sha256. (--from-bert: the old spelling)",
    )
    p.add_argument(
        "--task",
        choices=list(model_dir.TASKS),
        help="what the exported model answers, read with its head from --from's directory: embed (pooled "
        "vectors), rerank (a cross-encoder: *ForSequenceClassification of one label), classify (of several), sparse "
        "(SPLADE: *ForMaskedLM's logits through SpladePooling), tokens (every token's vector, no pooling). Default: "
        "what the directory says (a SparseEncoder's modules.json: sparse; config.json's architectures: a "
        "classification head; else embed)",
    )
    p.add_argument(
        "--inputs",
        choices=list(INPUTS),
        help="what the artifact takes: ids = token ids and text, the model's embedding layer (an Add & Norm) "
        "exported and gated as its own graph beside the block, and its tokenizer.json carried for the server; "
        "embeddings = the block's input embeddings only. Default: ids for a model directory with a "
        "tokenizer.json, else embeddings",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help="representative inputs: embeddings [N, S, E] as .npy, or .npz/.safetensors with 'embeddings' and "
        "optionally 'mask' [N, S] (true = padding) or 'lengths' [N]; or .txt, one sentence a line, embedded by "
        "--from's own tokenizer and embedding layer. A lossy variant's quality is judged on them and a few "
        "are kept as golden data; a model that takes text is judged on built-in sentences without it. Sentences "
        "also calibrate the quantized vectors' int8 and uint8 ranges (built-in sentences without them)",
    )
    p.add_argument(
        "--reference",
        choices=["auto", "transformers", "none"],
        default="auto",
        help="also compare with transformers' own model class on real sentences (--from a directory with a "
        "config.json): "
        "the converted encoder must compute what it computes (a wrong head count is caught here), and the "
        "graph's agreement is reported and kept in the manifest; auto (default) = transformers when it is "
        "installed and --from has a config.json",
    )
    p.add_argument(
        "--weights-seed",
        type=int,
        default=0,
        help="seed of the deterministic default weights, without --checkpoint or --from (default 0)",
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
        f"flash attention on CPU when nothing is padded; a GELU as onnxruntime's Gelu), onnx (ONNX's Attention operator, opset >= "
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
    g.add_argument("--d-model", type=int, help="the embedding width E (default 768)")
    g.add_argument("--nhead", type=int, help="attention heads; must divide --d-model (default 12)")
    g.add_argument("--dim-feedforward", type=int, help="the feed-forward's inner width (default 3072)")
    g.add_argument(
        "--feed-forward",
        choices=list(FEED_FORWARDS),
        help="plain (default): linear2(act(linear1(x))); gated: a GLU as ModernBERT's, linear1 twice as wide, "
        "its first half activated times its second",
    )
    g.add_argument("--num-layers", type=int, help="encoder blocks stacked (default 1)")
    g.add_argument(
        "--head",
        choices=list(HEADS),
        help="classify: a sequence-classification head on the first token (the scores output, --num-labels "
        "wide: a cross-encoder's one relevance score, or a classifier's logits); sparse: a masked-LM head and "
        "SPLADE's pooling (the sparse_weights output, --vocab-size wide). A model directory's head: --task (default none)",
    )
    g.add_argument("--vocab-size", type=int, help="the sparse head's outputs (the vocabulary's size)")
    g.add_argument("--num-labels", type=int, help="the classify head's outputs (config.json's id2label)")
    g.add_argument(
        "--head-activation",
        choices=list(HEAD_ACTIVATIONS),
        help="between the head's two products: tanh (BERT, RoBERTa, MPNet; default), relu (DistilBERT) or gelu "
        "(ELECTRA); a sparse head's: its family's (gelu)",
    )
    g.add_argument(
        "--activation", choices=["relu", "gelu"], help="the feed-forward's activation (default relu)"
    )
    g.add_argument("--layer-norm-eps", type=float, help="every LayerNorm's epsilon (default 1e-5)")
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
        "--pooling",
        choices=list(POOLINGS),
        help="add a 'pooled' output [batch, d_model] beside 'encoded': the sentence embedding, the mean over each "
        "sequence's real tokens or its first (cls) token, as sentence-transformers computes it (default none; "
        "a sentence-transformers model directory's own pooling with --from DIR)",
    )
    g.add_argument(
        "--normalize",
        dest="normalize_pooled",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalize the pooled output (sentence-transformers' Normalize module)",
    )
    g.add_argument(
        "--batch-first",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="embeddings as [batch, seq, d_model] (default) or [seq, batch, d_model] with --no-batch-first",
    )
    g.add_argument(
        "--packed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a padding-free graph: sequences of different lengths end to end, the per-token work on real tokens "
        "only and attention padded per sequence (the server merges any lengths without computing padding; "
        "Triton's ragged batching, addnorm-triton); its answers are the padded graph's (default padded)",
    )
    p.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when --artifact already holds a valid artifact (manifest and matching model.onnx)",
    )
    add_output(p)
    return p


def config_from_args(
    args: argparse.Namespace,
    detected: dict | None = None,
    declared: dict | None = None,
    pipeline: dict | None = None,
) -> EncoderConfig:
    """--config's file, then the flags; ``detected``: what a BERT checkpoint's weights say (layers, widths),
    under both; ``declared``: what its config.json says, which neither may contradict; ``pipeline``: the pooling
    a sentence-transformers directory applies (model_dir.sentence_pooling), which --config and the flags may change."""
    fields = EncoderConfig.load(args.config).to_dict() if args.config else {}
    flags = {name: getattr(args, name) for name in (*_CONFIG_FLAGS, *_SWITCHES)}
    if declared and flags["head"] is not None:  # --head decides over config.json's architectures
        declared = {k: v for k, v in declared.items() if k not in HEAD_FIELDS}
    if declared:
        if wrong := model_dir.contradictions(declared, {**fields, **flags}):
            raise ConfigError(
                "the model's config.json says otherwise than "
                + ", ".join(wrong)
                + ": leave those flags out (config.json decides)"
            )
        if wrong := model_dir.contradictions(declared, detected or {}, flags=False):
            raise ConfigError("the model's weights say otherwise than its config.json: " + ", ".join(wrong))
    if args.from_bert:
        fields = {**BERT_DEFAULTS, **(detected or {}), **(declared or {}), **(pipeline or {}), **fields}
        if flags["pooling"] == "none" and flags["normalize_pooled"] is None:
            fields["normalize_pooled"] = (
                False  # --pooling none on a directory that normalizes: nothing to normalize
            )
    for name, value in flags.items():
        if value is not None:
            fields[name] = value
    if fields.get("head") == "sparse" and "head_activation" not in fields:
        fields["head_activation"] = "gelu"  # a masked-LM head's transform (tanh is the classification head's)
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
    quiet_dependencies()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("addnorm").setLevel(logging.ERROR if args.quiet or args.json else logging.INFO)
    if args.if_missing and _valid_artifact(args.artifact):
        if not args.quiet:
            print(f"{args.artifact} already holds a valid artifact; nothing to do (--if-missing)")
        return 0
    try:
        if args.checkpoint and args.from_bert:
            raise ConfigError("give either --checkpoint or --from-bert, not both")
        variant = variant_from_args(args)
        state, detected, declared, where = None, None, None, None
        if args.task and (not args.from_bert or args.head is not None):
            raise ConfigError(
                "--task reads a model directory's head (--from DIR); --head builds one for a model without it: "
                "give one of them"
            )
        source = None
        if args.from_bert and hub.is_model_id(args.from_bert):  # ORG/NAME[@REVISION]: through the Hub's cache
            args.from_bert, source = hub.resolve(args.from_bert)
        if args.from_bert:  # its layer count and widths come from the weights, the rest from config.json
            state, declared, where = model_dir.read_model_dir(args.from_bert, args.task)
            detected = where.family.shape(state, where.config)
        pipeline = model_dir.sentence_pooling(where.directory) if where else None
        if args.task in ("tokens", "sparse"):  # every token's vector, or the sparse head's: no pooled vector
            pipeline = {**(pipeline or {}), "pooling": "none", "normalize_pooled": False}
        config = config_from_args(args, detected, declared, pipeline)
        reference = _reference(args, where)
        encoder = prepare_encoder(
            config,
            where.weights if where else args.checkpoint,
            args.weights_seed,
            state=state,
            family=where.family if where else None,
        )
        text = _text(args, where, state, config)
        given = []
        lines = sentences_of(args.calibration) if args.calibration else None
        if lines and text is not None:  # the model's own tokenizer and embedding layer, every family's
            text = dataclasses.replace(text, sentences=tuple(lines))
            x, mask = embed_sentences(text.module, text.tokenizer.read_bytes(), lines)
            given = calibration_cases(x, mask, config.d_model)
        elif args.calibration:
            x, mask = load_arrays(args.calibration, reference)
            given = calibration_cases(x, mask, config.d_model)
        if text is not None and not given:  # real text, not synthetic embeddings, for a model that takes text
            builtin = sentences.builtin_sentences()
            x, mask = embed_sentences(text.module, text.tokenizer.read_bytes(), builtin)
            given = calibration_cases(x, mask, config.d_model)
            log.info(
                "no --calibration: the gate judges on %d built-in sentences (%d-%d tokens), tokenized and embedded "
                "by the model's own tokenizer and embedding layer",
                len(builtin),
                int((~mask).sum(1).min()),
                int((~mask).sum(1).max()),
            )
        checks = []
        if reference is not None:
            checks.append(hf.reference_check(encoder, reference, given, config))
        if text is not None and _wants_reference(args):
            checks.append(hf.ids_check(where.directory, text.config, config))
        check = _both(checks)
        result = export_artifact(
            encoder,
            args.artifact,
            name=args.name,
            opset=args.opset,
            variant=variant,
            attention=args.attention,
            given=given,
            check=check,
            text=text,
            labels=_labels(where, config),
            source=source,
        )
    except ParityError as exc:
        print(format_table(exc.report, verbose=args.verbose), file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError, ExportError, GraphCheckError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.report.to_dict(), indent=2))
    elif not args.quiet:
        print(format_table(result.report, verbose=args.verbose))
        print(f"wrote {result.out_dir}/ (model.onnx sha256 {result.manifest.model_sha256[:12]}...)")
    return 0


def _text(
    args: argparse.Namespace, where: model_dir.ModelDir | None, state: dict | None, config: EncoderConfig
):
    """The embedding layer and tokenizer to export beside the block (--inputs ids), or None."""
    has_tokenizer = (
        where is not None and where.directory is not None and (where.directory / TOKENIZER_FILE).is_file()
    )
    if (args.inputs or (IDS if has_tokenizer else None)) != IDS:
        return None
    if not has_tokenizer:
        raise ConfigError(
            f"--inputs ids needs --from DIR, a model directory with a {TOKENIZER_FILE} (the server tokenizes with "
            "it); or give --inputs embeddings"
        )
    return text_export(where, state, config.d_model)


def _labels(where: model_dir.ModelDir | None, config: EncoderConfig) -> tuple[str, ...]:
    """config.json's label names for the head, where it names as many as the head has."""
    if where is None or where.config is None or config.head != "classify":
        return ()
    labels = where.family.labels(where.config)
    return labels if len(labels) == config.num_labels else ()


def _wants_reference(args: argparse.Namespace) -> bool:
    if args.reference == "none":
        return False
    if args.reference == "auto" and importlib.util.find_spec("transformers") is None:
        log.warning("no transformers installed: the export is not compared with transformers (--reference)")
        return False
    return True


def _both(checks: list):
    """The pipeline's one ``check``: every check's figures, merged."""
    if not checks:
        return None

    def check(model_path: Path) -> dict:
        result: dict = {}
        for one in checks:
            result.update(one(model_path))
        return result

    return check


def _reference(args: argparse.Namespace, where: model_dir.ModelDir | None) -> hf.Reference | None:
    """transformers' BertModel for --reference (a BERT model directory), or None (auto: when it can be had)."""
    if args.reference == "none":
        return None
    if where is not None and where.family is not BERT:
        return None  # the embeddings-level check is BERT's; every family gets ids_check (--inputs ids)
    if where is None or where.directory is None:
        if args.reference == "transformers":
            raise ConfigError(
                "--reference transformers needs --from-bert with a config.json (a model directory)"
            )
        return None
    if args.reference == "auto" and importlib.util.find_spec("transformers") is None:
        log.warning("no transformers installed: the export is not compared with BertModel (--reference)")
        return None
    return hf.Reference(where.directory, max_length=int(where.config.get("max_position_embeddings", 512)))


def _valid_artifact(out: Path) -> bool:
    try:
        load_verified(out)
    except ArtifactError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
