"""Answers to the chapter's exercises with measured data."""
