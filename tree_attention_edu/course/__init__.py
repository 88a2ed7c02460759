"""The course as lecturers use it: the student release of the notebooks and its grading
(`release`, by nbgrader), and how the notebooks print small numbers (`printing`). Imports
nothing else of the package."""
