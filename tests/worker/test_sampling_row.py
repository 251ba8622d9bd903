"""TokenSpan: a request's prompt or output tokens without a copy, read as the list slice would be; select_rows."""
import pytest
import torch

from tandem.worker.logits_processing import bad_word_bans, select_rows
from tandem.worker.sampling_row import TokenSpan


@pytest.mark.parametrize("start,stop,extra", [(0, 5, ()), (2, 5, ()), (5, 5, ()), (3, 5, (9, 8)), (5, 5, (7,))])
def test_a_span_reads_as_the_list_slice_plus_its_extra(start, stop, extra):
    tokens = [10, 11, 12, 13, 14, 15, 16]
    expected = tokens[start:stop] + list(extra)
    span = TokenSpan(tokens, start, stop, extra)
    assert len(span) == len(expected) and bool(span) == bool(expected)
    assert list(span) == expected and span == expected
    for i in range(-len(expected), len(expected)):
        assert span[i] == expected[i]
    for i in (len(expected), -len(expected) - 1):
        with pytest.raises(IndexError):
            span[i]
    assert span[1:] == expected[1:] and span[-2:] == expected[-2:]
    # the request's list grows after the span was made: the span keeps this step's tokens
    tokens.append(99)
    assert list(span) == expected


def test_bad_word_bans_read_a_span_as_a_list():
    tokens = [1, 2, 3, 4, 5]
    words = [[4, 5, 6], [5, 7], [8]]
    assert bad_word_bans(words, TokenSpan(tokens, 2, 5)) == bad_word_bans(words, tokens[2:5]) == [6, 7, 8]


def test_select_rows_keeps_the_order_asked_for():
    x = torch.arange(12.0).view(6, 2)
    for rows in ([0, 1, 2], [2, 3], [0, 2, 1, 3], [3, 3], [5, 0], [1, 2, 4]):
        got = select_rows(x, rows)
        assert torch.equal(got, x[rows]), rows
    assert select_rows(x, [1, 2, 3]).data_ptr() == x[1].data_ptr()  # consecutive: a view
