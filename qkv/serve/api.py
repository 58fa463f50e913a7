"""The body of ``POST /v1/translate`` and its answer: what each field may hold (the server's limits
are in the schema, so ``/openapi.json`` documents them), and the decoding settings a request asks for.

Each field is checked alone by pydantic; ``settings_of`` checks them together (sampling options need
``sampling``, ``n_best`` at most the beam) and names the field to change. Note: no ``from __future__
import annotations`` here, because FastAPI reads these models' annotations at run time.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, StringConstraints, field_validator

from qkv.errors import QkvError
from qkv.infer.glossary import MAX_TERM_CHARS, Glossary
from qkv.infer.numbers import Numbers
from qkv.serve.work import Settings

MAX_BEAM = 16  # what one client may ask of a shared server; `qkv translate --beam` goes to qkv.cli.common.MAX_BEAM (64)
MAX_GLOSSARY_TERMS = 1000  # entries of a request's glossary
MAX_TERM_FORMS = 16  # target forms of one entry
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0}  # options that only sampling reads


class AttentionOut(BaseModel):
    """One searched sentence's attention: a text searched as one sentence gets one of these."""

    source: str = Field(description="the sentence as the model read it (split from its text, recased)")
    translation: str = Field(description="the model's translation of it, before it was recased and joined")
    src_tokens: list[str] = Field(description="S source subword pieces, EOS last")
    tgt_tokens: list[str] = Field(description="T target subword pieces, EOS last")
    cross: list[list[list[list[float]]]] = Field(
        description="cross-attention weights (layers, heads, T, S): row t is where target token t looked"
    )
    contributions: list[list[list[float]]] = Field(
        description="ALTI+ contributions (layers, T, S): the share of each source token in the representation "
        "that predicts target token t after each decoder layer; the rest of row t (1 - its sum) is the target prefix's"
    )


class TextAttentionOut(BaseModel):
    """A text the server cut into several sentences and searched one by one: each sentence's attention."""

    source: str = Field(description="the text as sent")
    translation: str = Field(description="its translation, as in translations")
    sentences: list[AttentionOut] = Field(description="each sentence the model searched, in order, with its attention")


class WordOut(BaseModel):
    word: str
    prob: float = Field(description="the lowest probability the model gave one of the word's pieces")
    source: float = Field(description="the lowest share of the source in predicting one of its pieces (ALTI+, 0 to 1)")
    marked: bool = Field(description="true where either collapses: a word not to trust")


class TrustOut(BaseModel):
    confidence: float = Field(description="0 to 1, higher is more trustworthy (docs/trust.md)")
    flags: list[str] = Field(description="any of detached, partly-detached, repetition, recurrence, copy, omission, addition")
    why: dict[str, str] = Field(description="each flag's reason: its feature, value and threshold")
    features: dict[str, float] = Field(description="the signals the confidence is computed from")
    unused_source_words: list[int] = Field(description="0-based indices of the source words no target word used")
    words: list[WordOut] = Field(description="each target word, with its marks")


class TermOut(BaseModel):
    source: str = Field(description="the term as it stands in the text")
    source_words: list[int] = Field(description="0-based indices of the text's whitespace-separated words it covers")
    asked: str = Field(description="the target form the glossary asks for (its entry's first)")
    accepted: list[str] = Field(description="every target form the entry accepts")
    found: str | None = Field(description="the form that stands in the translation (null: missing)")
    target_words: list[int] = Field(description="0-based indices of the translation's words it covers")
    aligned_to: list[int] | None = Field(description="the source words those words align to (value norms, middle decoder layer)")
    placed: bool | None = Field(description="whether they include the term's own source words")
    number: bool = Field(False, description="whether the term is a number of the text (the request's numbers)")
    constrained: bool = Field(description="whether the constrained search made this translation (its first search missed a term)")
    substituted: bool = Field(False, description="whether a missing term was written in place of the words its source term "
                              "aligns to (a model with an alignment head), with no second search")
    unplaceable: bool = Field(description="whether the constrained search found no output with every term within its "
                              "length limit (the first translation is kept, its missing terms null)")
    sentence: int | None = Field(None, description="where the text was cut into sentences: the 0-based index of the "
                                 "term's sentence (its source_words and target_words count within that sentence)")


class Candidate(BaseModel):
    translation: str
    score: float = Field(
        description="length-normalised log-probability: log p(output | text) / ((5 + tokens) / 6) ** alpha, "
        "EOS included, alpha the checkpoint's length penalty, as `qkv translate --n-best` prints it (higher is better)"
    )


class SegmentOut(BaseModel):
    where: str = Field(description="where the segment is in its document (a line, a cue, an element)")
    source: str = Field(description="the segment's text as the model read it, its markup taken out")
    translation: str = Field(description="its translation, before its markup was put back")
    confidence: float | None = Field(None, description="with confidence: as for a text of lines (docs/trust.md)")
    flags: list[str] | None = Field(None, description="with confidence: the segment's flags")


class TranslateResponse(BaseModel):
    translations: list[str] = Field(description="one translation per input text, in order")
    n_best: list[list[Candidate]] | None = Field(
        None, description="only when the request has n_best: each text's n best translations with scores, best first"
    )
    attention: list[AttentionOut | TextAttentionOut] | None = Field(
        None, description="only when the request asked for attention: for each text, its attention (a text searched "
        "as one sentence), or its sentences' (a text split into several: TextAttentionOut)"
    )
    confidence: list[TrustOut] | None = Field(
        None, description="only when the request asked for confidence: whether to trust each translation, each "
        "sentence judged as the model read and wrote it (split, recased) and a text's sentences combined as "
        "`qkv translate --confidence` does: the least confident sentence's confidence and features, every "
        "sentence's flags, unused source words numbered across its sentences as the model read them"
    )
    terms: list[list[TermOut]] | None = Field(
        None, description="only when the request has a glossary: for each text, each term it asked for and where it went"
    )
    segments: list[list[SegmentOut]] | None = Field(
        None, description="only for documents (format) with confidence: each document's segments, where each is, "
        "and its confidence and flags"
    )


class ErrorOut(BaseModel):
    detail: str


def _whole_number(value: Any) -> Any:
    # JSON Schema counts 5.0 as an integer, so accept it (pydantic turns it into 5 and rejects 5.5),
    # but not true or "5", which pydantic's lax mode would take as numbers.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QkvError("must be a whole number")
    return value


def _whole_number_between(low: int, high: int) -> Any:
    # The bounds come first so that they appear in the JSON schema as minimum and maximum.
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_whole_number)]


def _number_between(low: float, high: float) -> Any:
    # Strict: true and "0.5" are not numbers; NaN and infinities (which Python's JSON parser reads) neither.
    return Annotated[float, Strict(), Field(ge=low, le=high, allow_inf_nan=False)]


def request_model(*, max_texts: int, max_chars: int, max_output: int, vocab_size: int) -> type[BaseModel]:
    """The request body, with this server's limits in its schema (so /openapi.json documents them)."""
    Text = Annotated[str, Strict(), StringConstraints(max_length=max_chars)]
    BeamSize = _whole_number_between(1, MAX_BEAM)
    OutputLength = _whole_number_between(1, max_output)
    NBest = _whole_number_between(1, MAX_BEAM)
    Temperature = _number_between(0.01, 100)  # 0.01 is already greedy in practice; far less overflows float32
    TopK = _whole_number_between(0, vocab_size)
    TopP = Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)]
    Seed = _whole_number_between(0, 2**53 - 1)  # the integers JavaScript holds exactly
    TermText = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=MAX_TERM_CHARS)]
    Entry = Annotated[list[TermText], Field(min_length=2, max_length=MAX_TERM_FORMS)]

    class TranslateRequest(BaseModel):
        model_config = ConfigDict(
            extra="forbid",  # a misspelt field is an error, not silently ignored
            json_schema_extra={
                "examples": [
                    {"texts": ["A man rides a bike."], "beam_size": 5},
                    {"texts": ["A man rides a bike."], "beam_size": 5, "n_best": 3},
                    {"texts": ["A man rides a bike."], "confidence": True},
                    {"texts": ["A man rides a bike."], "attention": True},
                    {"texts": ["<p>A man rides <b>a bike</b>.</p>"], "format": "html"},
                    {"texts": ["A man rides a bike."], "glossary": [["bike", "Fahrrad"]]},
                    {"texts": ["A man rides a bike."], "sampling": True, "top_p": 0.9, "seed": 1},
                ],
                # What settings_of checks, for readers of the schema (and fuzzers): sampling takes beam
                # size 1 and at most one of the n best; the sampling options, left at their defaults
                # otherwise. (That n_best is at most beam_size the schema cannot say.)
                "if": {"properties": {"sampling": {"const": True}}, "required": ["sampling"]},
                "then": {"properties": {"beam_size": {"const": 1}, "n_best": {"enum": [1, None]}}},
                "else": {"properties": {name: {"const": default} for name, default in SAMPLING_DEFAULTS.items()}},
            },
        )

        texts: list[Text] = Field(
            min_length=1, max_length=max_texts,
            description=f"sentences to translate: 1 to {max_texts}, each at most {max_chars} characters",
        )
        beam_size: BeamSize = Field(5, description="beam size (1 = greedy search)")
        max_length: OutputLength | None = Field(
            None, description=f"maximum output tokens, at most {max_output} (default: 1.5 x source tokens + 10)"
        )
        attention: StrictBool = Field(
            False, description="also return each translation's cross-attention, contributions and tokens"
        )
        confidence: StrictBool = Field(
            False, description="also return each translation's confidence, flags and per-word marks (docs/trust.md)"
        )
        n_best: NBest | None = Field(
            None, description="also return each text's n best translations (1 to beam_size) with their scores"
        )
        split: StrictBool = Field(
            True, description="cut each text into sentences by the source language's rules, translate them in one "
            "batch and join their translations (false: each text is one sentence); attention, confidence and a "
            "glossary's terms then describe each sentence searched, and a text's n best join its sentences' k-th "
            "bests (as qkv translate --n-best); not with max_length, which bounds one search of each text as sent"
        )
        keep_case: StrictBool = Field(
            False, description="translate a sentence in capitals or in Title Case as it is (default: in sentence "
            "case, and the translation of one in capitals written back in capitals); as split, not with max_length"
        )
        glossary: list[Entry] | None = Field(
            None, max_length=MAX_GLOSSARY_TERMS,
            description=f"terms every translation must use: at most {MAX_GLOSSARY_TERMS} entries [source term, target "
            f"term, further accepted forms...] (2 to {MAX_TERM_FORMS} strings of 1 to {MAX_TERM_CHARS} characters; "
            "docs/glossary.md); the answer's terms say where each went. Each text is cut into sentences and recased "
            "as without it (split, keep_case), as `qkv translate --glossary` does; not with n_best or sampling",
        )
        numbers: StrictBool = Field(
            False, description="every number a text writes in digits must stand in its translation, checked and "
            "searched for as a glossary term (docs/glossary.md#numbers, as `qkv translate --numbers`); the answer's "
            "terms say where each went. With a glossary, its terms win where a term and a number overlap. Each text "
            "is cut into sentences as with a glossary; not with n_best or sampling",
        )
        format: Literal["text", "html", "markdown", "srt", "vtt", "po"] | None = Field(
            None, description="each text is a whole document in this format, translated with its markup, placeholders "
            "and structure kept, as `qkv translate --format` does (docs/documents.md); the translations are the "
            "documents. With glossary, numbers and confidence (then segments says each segment's); not with "
            "n_best, sampling, attention or max_length. Without a format, a request one of whose texts holds a "
            "placeholder (a URL, an e-mail address, %s, {name}, an emoji) or a tab is translated as format text, "
            "unless it asks for n_best, sampling, attention, max_length, confidence, a glossary or numbers"
        )
        sampling: StrictBool = Field(
            False, description="draw each token at random instead of searching (beam_size 1, n_best at most 1)"
        )
        temperature: Temperature = Field(
            SAMPLING_DEFAULTS["temperature"],
            description="with sampling: divide the logits by this (lower: closer to greedy search)",
        )
        top_k: TopK = Field(
            SAMPLING_DEFAULTS["top_k"], description="with sampling: draw only among the k most likely tokens (0: all)"
        )
        top_p: TopP = Field(
            SAMPLING_DEFAULTS["top_p"],
            description="with sampling: draw only among the most likely tokens that together hold this probability",
        )
        seed: Seed = Field(
            SAMPLING_DEFAULTS["seed"],
            description="with sampling: the same text and seed give the same sample, however it is batched",
        )

        @field_validator("texts")
        @classmethod
        def _encodable(cls, texts: list[str]) -> list[str]:
            for i, text in enumerate(texts):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise QkvError(f"texts[{i}] is not valid Unicode (it contains a lone surrogate)") from None
            return texts

    return TranslateRequest




class InvalidOptions(QkvError):
    """Options that are each valid but not together; ``field`` is the one to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def settings_of(body: BaseModel) -> Settings:
    """The decoding settings a valid request asks for, or InvalidOptions. With sampling, beam_size
    defaults to 1 (sampling draws one translation per text). A sampling option other than its default
    without sampling is refused: the client expects an effect it would not have."""
    if body.sampling:
        if "beam_size" in body.model_fields_set and body.beam_size != 1:
            raise InvalidOptions("beam_size", "sampling draws one translation per text: beam_size must be 1 (or left out)")
        options = {name: getattr(body, name) for name in SAMPLING_DEFAULTS}
    else:
        for name, default in SAMPLING_DEFAULTS.items():
            if getattr(body, name) != default:
                raise InvalidOptions(name, f"{name} applies only to sampling: send it with \"sampling\": true, or leave it out")
        options = {}
    beam_size = 1 if body.sampling else body.beam_size
    glossary = None
    if body.glossary is not None or body.numbers:
        field = "glossary" if body.glossary is not None else "numbers"
        if body.sampling or body.n_best is not None:
            raise InvalidOptions(field, f"{'a glossary' if field == 'glossary' else 'numbers'} puts its terms into the one "
                                        "translation of each text: not with n_best or sampling")
        try:
            glossary = Glossary.from_pairs(body.glossary) if body.glossary is not None else None
        except QkvError as error:
            raise InvalidOptions("glossary", str(error)) from None
        glossary = Numbers(glossary) if body.numbers else glossary
    if body.n_best is not None and body.n_best > beam_size:
        if body.sampling:
            raise InvalidOptions("n_best", f"n_best ({body.n_best}) must be 1: sampling draws one translation per text")
        raise InvalidOptions("n_best", f"n_best ({body.n_best}) must be at most beam_size ({beam_size})")
    return Settings(
        beam_size=beam_size, max_length=body.max_length, sampling=body.sampling, n_best=body.n_best,
        attention=body.attention, confidence=body.confidence, glossary=glossary, **options,
    )
