"""core/mix"""
