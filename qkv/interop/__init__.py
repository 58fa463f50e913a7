"""Other toolkits' formats: Hugging Face Marian (OPUS-MT) import and export, CTranslate2 export."""
