"""The base layer: kt-ft's error, its log, the settings registry, the version, process
topology and atomic file writes. Imports nothing else of kt-ft and nothing heavy.
"""
