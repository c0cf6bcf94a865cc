"""The course chapter's API, its exercise and grader, and `attngrad explain`."""
