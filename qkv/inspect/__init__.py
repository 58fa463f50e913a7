"""Looking inside: attention step by step, pictures, beam traces, alignments, self-checks, the demo."""
