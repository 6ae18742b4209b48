"""The only part of kt-ft that imports llamafactory: argument and loader patches."""
