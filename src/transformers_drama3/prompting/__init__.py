"""The script model, the "reference-bracket-v1" layout, and rows in both directions.

- `text`: the vocabulary and the rules for caller text (taken as given; what is refused).
- `clips`: audio as codes, waveforms or files; the check of codes.
- `script`: the script model (lines, references, takes) and the requests, each with its layout.
- `chunking`: long text cut into chunks, the one place a request's text is normalised.
- `layout`: the segments every layout is built of (the one place the prompt structure is written).
- `phonemes`: the phoneme text front end (spoken text -> espeak-ng phonemes, tags as written).
- `encoding`: layout -> rows, with the layout's metadata (turn to speak, line boundaries).
- `text_stream`: text arriving in pieces cut into the streaming chunks as soon as they are final.
- `parsing`: rows -> the request they encode.
"""

from __future__ import annotations

from .text import (  # noqa: F401
    AUDIO_SEPARATOR,
    CODEBOOK_SIZE,
    IGNORE_INDEX,
    IM_END,
    IM_START,
    INTERLEAVE,
    LINE_BREAKS,
    MAX_SPEAKER,
    NUM_CODEBOOKS,
    NUM_SPEAKERS,
    POINT_TAG,
    REFERENCE_INSTRUCTION,
    SCOPED_TAG,
    SPEAKER_TAG,
    STRUCTURAL_TOKENS,
    TEMPLATE_VERSION,
    TEXT,
    TTS_INSTRUCTION,
    VOICE,
    WHITE_SPACE,
    check_caller_text,
    check_no_special_tokens,
    check_speaker,
    check_tags,
    flatten_line_breaks,
    is_cjk,
    leading_speaker,
    reference_transcript,
    semantic_token,
    speaker_tag_at,
    speaker_token,
    split_speaker_tags,
    strip_white_space,
    with_instruction,
    with_speaker_tag,
)
from .clips import (  # noqa: F401
    AudioLike,
    Clip,
    as_clip,
    check_codes,
)
from .layout import (  # noqa: F401
    Frames,
    LayoutContext,
    Literal,
    SUPERVISED_TURN_END,
    Segment,
    Special,
    Spoken,
    TURN_END,
    VOICE_START,
    lines_parts,
    part_text,
    render_lines,
    system_segments,
    take_segments,
    text_parts,
    turn_start,
    user_segments,
)
from .encoding import (  # noqa: F401
    PromptRows,
    TokenIds,
    encode_layout,
    encode_text,
)
from .chunking import (  # noqa: F401
    CHUNK_BYTES,
    CHUNK_SPEAKERS,
    chunk_lines,
    split_line_text,
)
from .script import (  # noqa: F401
    Infill,
    Line,
    LineByLineScript,
    MAX_REFERENCE_SECONDS,
    Reference,
    Request,
    SceneScript,
    Script,
    StreamingScript,
    StreamingSystemTurn,
    StreamingTurn,
    Take,
    as_lines,
    as_reference,
    as_take,
    assemble_infill,
    check_free_text,
    long_text_history,
    parse_text,
    revision,
    speaker_turns,
    turn_parts,
    turn_text,
    turn_source,
)
from .text_chunker import (  # noqa: F401
    TextChunk,
    TextStreamChunker,
    settled_length,
)
from .parsing import (  # noqa: F401
    Message,
    parse_rows,
    parse_system,
    rows_to_messages,
)
