"""The verdict: align two indexes by token ids, find the first call whose inputs are bit-identical
and whose outputs differ, and judge whether that is a state bug or float noise (batch-variance).
"""
