"""Documents, not lines: HTML, Markdown, subtitles (SRT, WebVTT), gettext catalogues and plain text with
placeholders, translated with their markup and structure kept.

One representation (``segments``: plain text with its markup as spans), a reader and a writer per format
(``formats``, ``html``, ``markdown``, ``subtitles``, ``po``), the placement of markup by the model's word
alignment (``placement``), and the pipeline that joins them to the translator (``translate``). The layer
sits above ``infer`` and ``inspect`` (it uses the translator and the alignment) and below ``serve`` and ``cli``.
"""
