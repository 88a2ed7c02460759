"""The course as lecturers use it: the student release of the notebooks and its grading
(`release`, by nbgrader). Imports nothing else of the package."""
